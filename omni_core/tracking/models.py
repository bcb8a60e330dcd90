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


def registered_checkpoint(uri: str, tracking_uri: str, download_to: Path, download: bool) -> str:
    """The checkpoint a `models:/NAME@ALIAS` (or `models:/NAME/VERSION`) URI names: an S3 location as
    registered, or (a checkpoint copied into a run's artifacts) the local folder it is downloaded into under
    `download_to` when `download` (one process per machine downloads; the others get the same folder)."""
    from mlflow.exceptions import MlflowException

    name, sep, alias = uri.removeprefix("models:/").partition("@")
    if not uri.startswith("models:/") or not name:
        raise ValueError(f"{uri!r}: a registered model is named models:/NAME@ALIAS or models:/NAME/VERSION")
    client = mlflow_client(tracking_uri)
    try:
        if sep:
            version = client.get_model_version_by_alias(name, alias)
        else:
            name, _, number = name.partition("/")
            version = client.get_model_version(name, number)
    except MlflowException as error:
        raise ValueError(f"{uri}: not in the registry at {tracking_uri} ({error.message})") from error
    source = str(version.source)
    if not source.startswith("runs:/"):
        return source
    target = download_to / f"{name}-v{version.version}"
    if download and not (target / source.rstrip("/").rsplit("/", 1)[-1]).is_dir():
        import mlflow.artifacts

        mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(target), tracking_uri=tracking_uri)
    return str(target / source.rstrip("/").rsplit("/", 1)[-1])
