"""Validate stage: the estimator against the real runtime on this machine, logged as predicted vs measured."""

from __future__ import annotations

import tempfile
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from flows import resolve, stage_dir
from omni_core.measure.validate import calibrate_and_validate
from omni_core.measure.validation_report import ValidationReport, validation_figure
from omni_core.recipe import Recipe
from omni_core.tracking import stage_run


@flow(name="validate")
def validate_flow(recipe: Recipe | str, overrides: list[str] | None = None) -> ValidationReport:
    """Calibrate this machine and run the validation plans (`estimate.validation`: quick or full) on the real
    runtime; log validation.json (every case, predicted and measured, per round), the predicted-vs-measured
    figure and the MAPE overall and per world size to the "validate" run. The runs' own data lives in a
    temporary folder (they save no checkpoint)."""
    r = resolve(recipe, overrides)
    with stage_run("validate", r, flow_run_id=flow_run.id) as run:
        out_dir = stage_dir(r, run.run_id)
        with tempfile.TemporaryDirectory(prefix="omni-validate-") as tmp:
            report = calibrate_and_validate(r.estimate.validation == "quick", Path(tmp))
        (out_dir / "validation.json").write_text(report.to_json())
        validation_figure(report, out_dir / "validation.png")
        metrics = {
            "validate/mape_pct": report.mape_pct,
            "validate/plans": len(report.rows),
            "validate/rounds": report.rounds,
            "validate/seconds": report.seconds,
        }
        metrics.update({f"validate/mape_pct/world{w}": v for w, v in report.mape_pct_by_world.items()})
        if report.measured_spread_pct is not None and report.predicted_spread_pct is not None:  # two rounds or more
            metrics["validate/measured_spread_pct"] = report.measured_spread_pct
            metrics["validate/predicted_spread_pct"] = report.predicted_spread_pct
        run.set_tags({"validate.device": report.device})
        run.log_metrics(metrics, step=0)
        run.log_artifacts(out_dir)
        return report
