"""Prefect flows and tasks around omni_core: thin wrappers that take a recipe, open the MLflow run of
their stage and call the library; the experiment flow resolves the recipe once and hands it, and each
stage's typed result, to the next. Telemetry is off and Prefect's defaults are set before Prefect or
MLflow is imported."""

import os
from collections.abc import Sequence
from pathlib import Path

from omni_core.recipe import Recipe, load_recipe, override_recipe
from omni_core.tracking import disable_telemetry

disable_telemetry()
# The first ephemeral Prefect API on a fresh PREFECT_HOME runs its migrations, which can outlast Prefect's 20 s
# startup default on a small machine.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def stage_dir(recipe: Recipe, run_id: str) -> Path:
    """Local files of one stage run (resolved recipe, results, figures): <output_dir>/<experiment>/runs/<run id>."""
    path = Path(recipe.experiment.output_dir) / recipe.experiment.name / "runs" / run_id
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve(recipe: Recipe | str, overrides: Sequence[str] | None) -> Recipe:
    """A stage's recipe: the resolved Recipe the experiment flow hands down, or a file (a stage run alone),
    with `overrides` applied either way."""
    if isinstance(recipe, Recipe):
        return override_recipe(recipe, overrides or ())
    return load_recipe(recipe, overrides or ())
