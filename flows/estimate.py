"""Estimate stage: the recipe's jobs on every Cell of its cluster (Crius), logged as a CellTable."""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from flows import resolve, stage_dir
from omni_core.data.profile_result import DatasetProfile
from omni_core.estimator.calibration import calibration_path
from omni_core.estimator.recipe_cells import cell_figure, estimate_recipe
from omni_core.estimator.search import CellTable
from omni_core.recipe import Recipe
from omni_core.tracking import stage_run


@flow(name="estimate")
def estimate_flow(
    recipe: Recipe | str, overrides: list[str] | None = None, profile: DatasetProfile | None = None
) -> CellTable:
    """Enumerate Cells, search the best plan in each (document lengths and encoder tokens from `profile`
    when given); log cells.json, a step-time/memory figure, each job's best predicted throughput, and the
    stored calibration each GPU type's estimates used (calibration/<type>.json; its digest as a tag)."""
    r = resolve(recipe, overrides)
    with stage_run("estimate", r, flow_run_id=flow_run.id) as run:
        out_dir = stage_dir(r, run.run_id)
        table = estimate_recipe(r, profile)
        table.save(out_dir / "cells.json")
        if table.cells:
            cell_figure(table, out_dir / "cells.png")
        metrics = {}
        for job in dict.fromkeys(c.job for c in table.cells):
            best = table.best(job)
            assert best is not None  # the job is one of the table's rows
            metrics[f"estimate/{job}/samples_per_s"] = best.samples_per_s
            metrics[f"estimate/{job}/step_time_s"] = best.step_time_s
            run.set_tags({f"estimate.{job}.plan": f"{best.gpu_type}x{best.num_gpus}:{best.plan}"})
        for gpu_type, digest in table.calibrations.items():
            run.set_tags({f"estimate.calibration.{gpu_type}": digest or "catalogue"})
            if digest:
                run.log_artifact(calibration_path(gpu_type), "calibration")
        metrics["estimate/cells"] = len(table.cells)
        metrics["estimate/unfit_jobs"] = len(table.unfit)
        run.log_metrics(metrics, step=0)
        run.log_artifacts(out_dir)
        return table
