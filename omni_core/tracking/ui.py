"""Where a person browses a flow run's results: the MLflow UI's page of an experiment's training runs."""

from __future__ import annotations

from urllib.parse import urlsplit

MLFLOW_UI_ADDRESS = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store by default


def runs_page_url(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's Runs page in the UI's "Model training" view, served by the tracking server itself or,
    for a local store, by `mlflow ui` at its default address. MLflow's UI keeps its GenAI / Model training switch
    in the browser's local storage and opens a fresh browser on GenAI (mlflow#24498) whatever the experiment's
    kind; the page's `workflowType` parameter overrides that switch, so this link lands on the runs."""
    base = tracking_uri.rstrip("/") if urlsplit(tracking_uri).scheme in ("http", "https") else MLFLOW_UI_ADDRESS
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
