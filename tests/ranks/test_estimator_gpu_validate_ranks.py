"""The GPU validation path (benchmarks/estimator_gpu_validate.py) run on CPU ranks, where there is no GPU: it
calibrates, validates and writes the CPU validation's keys, which `estimator_bench.py --repredict` reads back.
Its GPU branch (NCCL ranks, bf16, CUDA probes) runs only where a GPU is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_validation_script_writes_the_validations_keys_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CALIBRATION_DIR", str(tmp_path / "calibration"))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import estimator_gpu_validate

    out = tmp_path / "v.json"
    estimator_gpu_validate.main(["--quick", "--device", "cpu", "--out", str(out)])
    report = json.loads(out.read_text())
    assert {"mape_pct", "mape_pct_by_world", "n_plans_validated", "validation_rounds", "measured_spread_pct",
            "predicted_spread_pct", "validation", "device", "gpus", "calibration", "device_calibration"} <= set(report)
    assert report["n_plans_validated"] == len(report["validation"]) == 3
    assert set(report["mape_pct_by_world"]) == {"1", "2"}
    for row in report["validation"]:
        assert row["measured_s"] > 0 and row["predicted_s"] > 0
    assert (tmp_path / "calibration" / "cpu.json").exists()  # step 1 stored the device's calibration
    sys.modules.pop("estimator_gpu_validate", None)

    # the report predicted again from its own calibrations (estimator_bench --repredict) gives its predictions
    import estimator_bench

    again = estimator_bench.repredicted(out)
    assert again["source_mape_pct"] == report["mape_pct"] and again["mape_pct"] == pytest.approx(report["mape_pct"])
    for row, stored in zip(again["validation"], report["validation"], strict=True):
        assert row["case"] == stored["case"] and row["measured_s"] == stored["measured_s"]
        assert row["predicted_rounds_s"] == pytest.approx(stored["predicted_rounds_s"], rel=1e-9)
    sys.modules.pop("estimator_bench", None)
