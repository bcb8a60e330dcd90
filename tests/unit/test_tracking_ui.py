"""The link `omni run` prints to browse its runs: the experiment's Runs page in MLflow's Model training view."""

from __future__ import annotations

from pathlib import Path

from flows.commands.stages import _browse_hint
from omni_core.tracking import runs_page_url


def test_a_local_store_is_browsed_through_mlflow_ui_at_its_default_address():
    url = runs_page_url("sqlite:////tmp/x/mlflow.db", "7")
    assert url == "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"


def test_a_tracking_server_serves_its_own_page():
    url = runs_page_url("https://mlflow.example.org/", "12")
    assert url == "https://mlflow.example.org/#/experiments/12/runs?workflowType=machine_learning"


def test_the_summary_names_the_page(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    here = f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    page = runs_page_url(here, "3")
    assert _browse_hint({"tracking_uri": here, "runs_page": page}) == f"mlflow ui   then open {page}"
    elsewhere = "sqlite:////data/mlflow.db"
    assert _browse_hint({"tracking_uri": elsewhere, "runs_page": page}).startswith(
        f"mlflow ui --backend-store-uri {elsewhere}   then open {page}"
    )
    server = "http://mlflow:5000"
    assert _browse_hint({"tracking_uri": server, "runs_page": runs_page_url(server, "3")}) == (
        "open http://mlflow:5000/#/experiments/3/runs?workflowType=machine_learning"
    )
