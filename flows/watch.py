"""Watch stage: one look at the running re-planned job of a recipe's experiment (`omni watch`), from outside
the train stage that launched it; a decision to re-plan becomes the job's stop request, and the train stage
relaunches it under the new plan."""

from __future__ import annotations

from prefect import flow

from flows import resolve
from flows.train import PARENT_FILE, log_decision
from omni_core.recipe import Recipe
from omni_core.scheduler.replan import ReplanDecision, control_folder, look_from_outside
from omni_core.tracking import children_of


@flow(name="watch")
def watch_flow(recipe: Recipe | str, overrides: list[str] | None = None) -> ReplanDecision:
    """Look once; the look is an MLflow run beside the job's train run, under its experiment run."""
    from omni_core.runtime.perf import local_device_type

    r = resolve(recipe, overrides)
    decision, window = look_from_outside(r, local_device_type())
    with children_of((control_folder(r) / PARENT_FILE).read_text().strip() or None):
        log_decision(r, decision, window)
    return decision
