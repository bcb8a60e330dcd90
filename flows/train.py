"""Train stage: torchrun on the resolved recipe, rank 0 logging into this stage's MLflow run."""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from flows import resolve, stage_dir
from flows.launcher import run_torchrun
from omni_core.common.results import TrainResult
from omni_core.estimator.search import CellTable
from omni_core.recipe import Recipe, dump_recipe
from omni_core.runtime.checkpoint import local_manifest
from omni_core.tracking import log_checkpoint, register_checkpoint, stage_run


def planned(recipe: Recipe, cells: CellTable | None) -> Recipe:
    """The recipe with `parallel.plan: auto` replaced by the estimate's best plan for this machine's Cell;
    without the estimate stage's CellTable (`omni train` alone), that one Cell's estimate is made here."""
    if recipe.parallel.plan != "auto":
        return recipe
    from omni_core.estimator.recipe_cells import estimate_own_cells, with_best_plan
    from omni_core.runtime.perf import local_device_type

    device = local_device_type()
    return with_best_plan(recipe, cells or estimate_own_cells(recipe, device), device)


@flow(name="train")
def train_flow(recipe: Recipe | str, overrides: list[str] | None = None, cells: CellTable | None = None,
               run_name: str = "train") -> TrainResult:
    """Run `torchrun -m omni_core.runtime.launch` on the resolved recipe (overrides applied; `parallel.plan:
    auto` replaced by the best plan of `cells` for this machine's Cell), with the MLflow run's id (named
    `run_name`: the schedule stage names each job's segment) in MLFLOW_RUN_ID; then log the checkpoint
    (copied, or referenced when on S3), register it in the Model Registry under tracking.model_alias, and
    log train_result.json."""
    given = resolve(recipe, overrides)
    r = planned(given, cells)
    with stage_run(run_name, r, flow_run_id=flow_run.id) as run:
        run_dir = stage_dir(r, run.run_id)
        resolved = run_dir / "recipe.yaml"
        resolved.write_text(dump_recipe(r))
        if r is not given:  # what ran is not what the experiment's recipe says: keep it beside the run
            run.set_tags({"plan.chosen_by": "estimate"})
            run.log_artifact(resolved)
        result_path = run_dir / "train_result.json"
        result = run_torchrun(
            str(resolved),
            r.parallel.nproc,
            str(result_path),
            {"MLFLOW_RUN_ID": run.run_id, "MLFLOW_TRACKING_URI": run.uri},
            r.train.timeout_s,
        )
        source = log_checkpoint(run, result.checkpoint, local_manifest(r, result.checkpoint))
        register_checkpoint(
            run, name=r.tracking.registered_model or r.experiment.name, source=source, alias=r.tracking.model_alias
        )
        run.log_artifact(result_path)
        return result
