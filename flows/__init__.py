"""Prefect flows and tasks around omni_core: thin wrappers that load a recipe, open the MLflow run of
their stage and call the library. Telemetry is off and Prefect's defaults are set before Prefect or
MLflow is imported."""

import os
from pathlib import Path

from omni_core.recipe import Recipe
from omni_core.tracking import disable_telemetry

disable_telemetry()
# The first ephemeral Prefect API on a fresh PREFECT_HOME runs its migrations: past Prefect's 20 s default on 2 cores.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def stage_dir(recipe: Recipe, run_id: str) -> Path:
    """Local files of one stage run (resolved recipe, results, figures): <output_dir>/<experiment>/runs/<run id>."""
    path = Path(recipe.experiment.output_dir) / recipe.experiment.name / "runs" / run_id
    path.mkdir(parents=True, exist_ok=True)
    return path
