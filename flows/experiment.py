"""The experiment flow: profile -> estimate -> train -> evaluate under one MLflow parent run; a recipe with
`jobs` runs profile -> estimate -> schedule, the schedule stage training every job. The recipe is resolved
once and each stage gets it, and the typed results it needs, from here: the DatasetProfile to estimate
(and schedule), the CellTable to train (`parallel.plan: auto`) and schedule."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel

from flows.estimate import estimate_flow
from flows.evaluate import evaluate_flow
from flows.profile import profile_flow
from flows.schedule import schedule_flow
from flows.train import train_flow
from omni_core.recipe import load_recipe, recipe_hash
from omni_core.scheduler.local import check_recipe
from omni_core.tracking import parent_run, runs_page_url


@flow(name="experiment")
def experiment_flow(recipe: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Run the stages in order as subflows; each logs into a child of the run `<experiment>-<flow run name>`."""
    r = load_recipe(recipe, overrides or ())
    if r.jobs:
        check_recipe(r)  # before any stage runs
    name = f"{r.experiment.name}-{flow_run.name}"
    with parent_run(r, flow_run_id=flow_run.id, run_name=name) as run:
        profile = profile_flow(r)
        cells = estimate_flow(r, profile=profile)
        results: dict[str, BaseModel]  # each stage's typed result
        if r.jobs:
            results = {"schedule": schedule_flow(r, profile=profile, cells=cells)}
        else:
            trained = train_flow(r, cells=cells, profile=profile)
            results = {"train": trained, "evaluate": evaluate_flow(r, checkpoint=trained.checkpoint)}
    return {
        "parent_run_id": run.run_id,
        "run_name": name,
        "tracking_uri": run.uri,
        "experiment_name": r.mlflow_experiment(),
        "runs_page": runs_page_url(run.uri, run.experiment_id) if run.experiment_id else None,
        "recipe_hash": recipe_hash(r),
        "profile": profile.model_dump(mode="json"),
        "estimate": cells.model_dump(mode="json"),
        **{stage: result.model_dump(mode="json") for stage, result in results.items()},
    }
