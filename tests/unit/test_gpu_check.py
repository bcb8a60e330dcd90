"""benchmarks/gpu_check.py: its CPU dry run end to end (every section runs and none errs, the report has its
figures, neither MLflow nor Prefect is imported), how the report names errors and skips, and the throughput
section's fallback to more activation checkpointing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_core.runtime.dist import DistInfo

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SECTIONS = ["environment", "correctness", "throughput", "attention", "estimator"]


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_dry_run_runs_every_section(tmp_path):
    # The dry run's own budget is 88 s; a loaded test machine gets more, so that only a failure fails the test.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMNI_CALIBRATION_DIR": str(tmp_path / "calibration")}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-dry-run", "--out", str(tmp_path / "out"), "--budget-s", "400"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    sections = report["sections"]
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert list(sections) == SECTIONS
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(SECTIONS, "ok"), log[-3000:]
    assert all(s["imported_forbidden"] == [] for s in sections.values())

    env_section = sections["environment"]
    assert env_section["matmul"]["tflops"] > 0 and env_section["peak"]["name"].startswith("cpu")
    assert env_section["gpu"]["status"] == "skipped"

    correctness = sections["correctness"]
    paths = correctness["attention_parity"]["paths"]
    assert paths["sdpa_causal"]["status"] == "ok" and paths["sdpa_bidirectional"]["status"] == "ok"
    assert paths["flex_causal"]["status"] == "skipped"  # no backward on CPU: a named skip, not a silent one
    step = correctness["step_nccl_fsdp_checkpoint"]
    assert step["collectives_in_step"].get("all_reduce", 0) >= 1  # the one-rank shortcut was off
    assert step["fsdp_modules"] > 0 and (step["param_dtype"], step["reduce_dtype"]) == ("bfloat16", "float32")
    assert step["losses_after_save"] == step["losses_after_load"]
    layouts = correctness["layouts_world1"]["losses"]
    assert layouts["dp1"] == layouts["dp1+omni"]

    for workload in ("text_only", "image_text_1to1"):
        figures = sections["throughput"][workload]
        assert figures["steps_timed"] == 2 and figures["tokens_per_s"] > 0 and figures["mfu_pct"] > 0
        assert figures["host_syncs_per_step"] is not None and figures["peak_memory_gib"] > 0
        assert figures["recompiles_after_warmup"] == 0  # eager on CPU: nothing compiles
    assert sections["throughput"]["image_text_1to1"]["image_to_text_tokens"] > 0

    timings = sections["attention"]["timings"]
    assert timings["sdpa_ms"] > 0 and timings["paths_skipped"]["varlen"]["status"] == "skipped"  # CUDA only
    cases = sections["estimator"]["validation"]["cases"]
    assert cases and all(c["predicted_s"] > 0 and c["measured_s"] > 0 for c in cases)
    ours = sections["estimator"]["throughput_predicted"]["workloads"]
    assert ours.keys() == {"text_only", "image_text_1to1"}
    for name, predicted in ours.items():  # beside the throughput section's own measurement
        assert predicted["predicted_s"] > 0 and predicted["measured_s"] == sections["throughput"][name]["step_s_mean"]

    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert all(f"[ok] {name}" in summary for name in SECTIONS)
    assert "errors:\n    none" in summary and "flex_causal" in summary  # the skip is named


def test_the_summary_names_errors_and_skips_however_deep():
    gpu_check = load_script()
    report = {
        "mode": "gpu",
        "budget_s": 450,
        "wall_s": 12,
        "sections": {
            "environment": {"status": "ok", "wall_s": 3},
            "throughput": {
                "status": "error",
                "wall_s": 9,
                "text_only": {"status": "error", "error": "OutOfMemoryError: CUDA out of memory\n...\nlast"},
                "image_text_1to1": {"status": "skipped", "reason": "the budget was spent"},
            },
        },
    }
    assert gpu_check.findings(report["sections"], "error") == [
        ("throughput.text_only", "OutOfMemoryError: CUDA out of memory ... last")
    ]
    text = gpu_check.summary(report)
    assert "[error] throughput" in text and "throughput.text_only: OutOfMemoryError" in text
    assert "throughput.image_text_1to1: the budget was spent" in text


def test_a_workload_that_runs_out_of_memory_runs_again_with_more_checkpointing(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    train = importlib.import_module("gpu_check_train")
    model = train.ThroughputModel(DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), train.DRY)
    tried = []

    def runs_out_twice(ctx, model, workload):
        tried.append(model.checkpointing)
        if len(tried) <= 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"steps_timed": 20}

    monkeypatch.setattr(train, "timed_run", runs_out_twice)
    figures = train.workload_throughput(None, "text_only", model)
    assert tried == ["none", "selective", "full"] and figures["steps_timed"] == 20
    assert [a["activation_checkpointing"] for a in figures["attempts"]] == ["none", "selective"]
    tried.clear()  # out of memory again under full checkpointing: nothing is left to try
    with pytest.raises(RuntimeError, match="every activation checkpointing"):
        train.workload_throughput(None, "image_text_1to1", model)


def test_a_spent_budget_skips_the_sections_without_starting_them(tmp_path):
    gpu_check = load_script()
    report = gpu_check.run_all(["throughput", "estimator"], tmp_path, dry_run=True, budget=1.0)
    assert {n: s["status"] for n, s in report["sections"].items()} == {"throughput": "skipped", "estimator": "skipped"}
    assert (tmp_path / "gpu_check.log").read_text() == ""  # no section's process was started
    assert json.loads((tmp_path / "report.json").read_text())["sections"]["estimator"]["status"] == "skipped"
