"""The estimator in benchmarks/gpu_check.py: the quick GPU validation as `estimator_gpu_validate.py --quick` runs
it (the device's calibration, then a few one-GPU cases predicted and measured), and the cost model's prediction
of the throughput section's own steps (omni-1b at seq_len 8,192) from that calibration, beside what the
throughput section measured."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

# The validation's cases are named by mix; the throughput workloads' predictions take the nearest one's name.
WORKLOAD_MIX = {"text_only": "text", "image_text_1to1": "image"}


def estimator(ctx) -> dict[str, Any]:
    os.environ.setdefault("OMNI_CALIBRATION_DIR", str(ctx.out / "calibration"))
    ctx.part("validation", quick_validation)
    ctx.part("throughput_predicted", throughput_predictions)
    return {"calibration_dir": os.environ["OMNI_CALIBRATION_DIR"]}


def quick_validation(ctx) -> dict[str, Any]:
    """`estimator_gpu_validate.py --quick` (on CPU ranks in a dry run): predicted against measured step time per
    case, and the kernels its first one-device case was calibrated with."""
    from estimator_gpu_validate import main as validate  # a sibling script, not a package

    scratch = ctx.out / ".estimator.json"
    try:
        full = validate(["--quick", "--out", str(scratch), "--device", ctx.device.type])
    except SystemExit as refused:  # the GPU is not in the catalogue: the script exits with the reason
        raise RuntimeError(str(refused)) from None
    finally:
        scratch.unlink(missing_ok=True)
    rows = [
        {k: row[k] for k in ("case", "world", "predicted_s", "measured_s", "ape_pct")} for row in full["validation"]
    ]
    one_device = next(row["case"] for row in full["validation"] if row["world"] == 1)
    keys = ("device", "gpus", "mape_pct", "mape_pct_by_world", "n_plans_validated", "total_seconds")
    return {
        **{key: full.get(key) for key in keys},
        "cases": rows,
        "kernels_of": one_device,
        "kernels": full["calibration"][0]["kernels"][one_device],
    }


def throughput_predictions(ctx) -> dict[str, Any]:
    """The cost model's step time and peak memory for each throughput workload, from the device's calibration
    and the profile of the workload's own data (its batches came from the loader before the clock started:
    no host data path is priced), against the throughput section's measurement. `predict` sizes the patch
    embedding by the validation cases' 8 px patches, not the workload's 14: under 0.1% of omni-1b's FLOPs."""
    from gpu_check_train import WORKLOADS, make_recipe, sizes

    from omni_core.data.profile import profile_dataset
    from omni_core.measure.case_prediction import predict
    from omni_core.measure.cases import Case

    validation = ctx.report.get("validation", {})
    if "kernels" not in validation:
        raise RuntimeError("the validation made no calibration to predict from")
    spec, eff, precision = calibrated_device(ctx, validation["kernels"])
    measured = throughput_measured(ctx.out)
    s = sizes(ctx.dry_run)
    predictions: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as root:
        for workload, mix in WORKLOADS.items():
            recipe = make_recipe(Path(root), s, s.flavor, s.seq_len, mix)
            profile = profile_dataset(recipe, Path(root) / workload, draw=False)[0]
            case = Case(s.flavor, "dp1", s.seq_len, mix=WORKLOAD_MIX[workload])
            estimate = predict(case, profile, spec, eff, precision=precision)
            got = measured.get(workload, {})
            step_s = got.get("step_s_mean")
            predictions[workload] = {
                "predicted_s": estimate.step_time_s,
                "measured_s": step_s,
                "ape_pct": 100 * abs(estimate.step_time_s - step_s) / step_s if step_s else None,
                "predicted_peak_memory_gib": estimate.peak_mem_bytes / 2**30,
                "measured_peak_memory_gib": got.get("peak_memory_gib"),
            }
    return {"flavor": s.flavor, "seq_len": s.seq_len, "workloads": predictions}


def calibrated_device(ctx, kernels: dict[str, float]):
    """(device, efficiency, precision) as the validation calibrated them for a one-device case: on a CPU host
    with this host's cores (`measure.validate`'s rule)."""
    from omni_core.measure.gpu_validation import validation_setup
    from omni_core.measure.measured_efficiency import with_compute

    spec, _, at, _ = validation_setup(ctx.device.type, quick=True)
    host = spec if at.device == "cuda" else replace(spec, cores=os.cpu_count() or 1)
    device, eff = with_compute(host, kernels, at)
    return device, eff, at.precision


def throughput_measured(out: Path) -> dict[str, Any]:
    """The throughput section's figures in the report written so far ({} when it did not run)."""
    report = out / "report.json"
    if not report.is_file():
        return {}
    return json.loads(report.read_text())["sections"].get("throughput", {})
