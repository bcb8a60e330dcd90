"""Train stage: torchrun on the resolved recipe, rank 0 logging into this stage's MLflow run."""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from flows import stage_dir
from flows.launcher import run_torchrun
from omni_core.common.results import TrainResult
from omni_core.recipe import dump_recipe, load_recipe
from omni_core.runtime.checkpoint import local_manifest
from omni_core.tracking import log_checkpoint, register_checkpoint, stage_run


@flow(name="train")
def train_flow(recipe: str, overrides: list[str] | None = None, run_name: str = "train") -> TrainResult:
    """Run `torchrun -m omni_core.runtime.launch` on the resolved recipe (overrides applied), with the
    MLflow run's id (named `run_name`: the schedule stage names each job's segment) in MLFLOW_RUN_ID; then
    log the checkpoint (copied, or referenced when on S3), register it in the Model Registry under
    tracking.model_alias, and log train_result.json."""
    r = load_recipe(recipe, overrides or ())
    with stage_run(run_name, r, flow_run_id=flow_run.id) as run:
        run_dir = stage_dir(r, run.run_id)
        resolved = run_dir / "recipe.yaml"
        resolved.write_text(dump_recipe(r))
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
