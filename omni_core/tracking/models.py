"""Checkpoints in MLflow: a pointer and the manifest on the train run, and the final checkpoint as a
version of a registered model with a moving alias (e.g. `models:/quickstart@current`)."""

from __future__ import annotations

import json
from pathlib import Path

from omni_core.tracking.store import mlflow_client
from omni_core.tracking.tracker import MlflowTracker


def log_checkpoint(run: MlflowTracker, location: str, manifest: Path) -> str:
    """Tag the run with the checkpoint's location and keep its manifest; returns the model source URI.

    A local checkpoint is copied into the run's artifacts (the run then holds the model even if the
    output directory is cleaned); an S3 checkpoint already lives in durable storage and is referenced.
    """
    run.set_tags({"checkpoint.uri": location, "checkpoint.step": json.loads(manifest.read_text())["step"]})
    if location.startswith("s3://"):
        run.log_artifact(manifest, "checkpoint")
        return location
    run.log_artifacts(location, "checkpoint")
    return f"runs:/{run.run_id}/checkpoint"


def register_checkpoint(run: MlflowTracker, *, name: str, source: str, alias: str) -> str:
    """Register `source` as a new version of model `name` and point `alias` at it; returns the version."""
    from mlflow.exceptions import MlflowException

    client = mlflow_client(run.uri)
    try:
        client.create_registered_model(name, description="omni checkpoints (DCP directory + manifest.json)")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = client.create_model_version(name, source=source, run_id=run.run_id).version
    client.set_registered_model_alias(name, alias, version)
    run.set_tags({"registered_model": f"models:/{name}@{alias}", "registered_model.version": version})
    return str(version)
