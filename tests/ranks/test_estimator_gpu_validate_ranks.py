"""The GPU validation path (omni_core.measure.gpu_validation, which benchmarks/estimator_gpu_validate.py runs) on CPU
ranks, where there is no GPU: it calibrates, validates and reports the CPU validation's keys, which
`stored_reports.repredicted` (`estimator_bench.py --repredict`) reads back. Its GPU branch (NCCL ranks, bf16, CUDA
probes) runs only where a GPU is."""

from __future__ import annotations

import json

import pytest

from omni_core.measure.gpu_validation import gpu_validation
from omni_core.measure.stored_reports import repredicted


def test_gpu_validation_script_writes_the_validations_keys_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CALIBRATION_DIR", str(tmp_path / "calibration"))
    report = gpu_validation("cpu", quick=True)
    out = tmp_path / "v.json"
    out.write_text(json.dumps(report))  # as the script stores it
    assert {"mape_pct", "mape_pct_by_world", "n_plans_validated", "validation_rounds", "measured_spread_pct",
            "predicted_spread_pct", "validation", "device", "gpus", "calibration", "device_calibration"} <= set(report)
    assert report["n_plans_validated"] == len(report["validation"]) == 3
    assert set(report["mape_pct_by_world"]) == {"1", "2"}
    for row in report["validation"]:
        assert row["measured_s"] > 0 and row["predicted_s"] > 0
    assert (tmp_path / "calibration" / "cpu.json").exists()  # step 1 stored the device's calibration

    # the report predicted again from its own calibrations (estimator_bench --repredict) gives its predictions
    again = repredicted(out)
    assert again["source_mape_pct"] == report["mape_pct"] and again["mape_pct"] == pytest.approx(report["mape_pct"])
    for row, stored in zip(again["validation"], report["validation"], strict=True):
        assert row["case"] == stored["case"] and row["measured_s"] == stored["measured_s"]
        assert row["predicted_rounds_s"] == pytest.approx(stored["predicted_rounds_s"], rel=1e-9)
