"""omni_core.tracking without a store: URIs and health check, the null tracker, a run refused before it starts
(trackers and the run tree on a sqlite store: tests/flows/test_tracking_flows.py)."""

from __future__ import annotations

import socket
import time

import pytest

from omni_core.recipe import Recipe
from omni_core.runtime.ranks import free_port
from omni_core.tracking import (
    NullTracker,
    TrackingError,
    artifact_location,
    check_tracking_uri,
    parent_run,
    resolve_tracking_uri,
    sanitize_metric_name,
)
from tests.helpers.tracking import make_recipe

# --- names and URIs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("train/loss", "train/loss"),
        ("perf/tokens_per_s", "perf/tokens_per_s"),
        ("perf/mfu %", "perf/mfu__"),
        ("eval/image loss (avg)", "eval/image_loss__avg_"),
        ("/leading//double/", "leading/double"),
        ("a/../b/./c", "a/_/b/_/c"),
        ("", "_"),
        ("x" * 300, "x" * 250),
    ],
)
def test_sanitize_metric_name(raw, clean):
    assert sanitize_metric_name(raw) == clean


def test_sanitized_names_are_accepted_by_mlflow():
    from mlflow.utils.validation import _validate_metric_name

    for raw in ["a:b", "ü/ß", "..", "x/./y", "tab\there", "/"]:
        _validate_metric_name(sanitize_metric_name(raw))


def test_tracking_uri_precedence_and_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///sub/x.db")
    assert resolve_tracking_uri() == f"sqlite:///{tmp_path / 'sub/x.db'}"
    recipe = Recipe.model_validate({"experiment": {"name": "e"}, "tracking": {"uri": "http://mlflow:5000"}})
    assert resolve_tracking_uri(recipe) == "http://mlflow:5000"
    assert resolve_tracking_uri(Recipe.model_validate({"experiment": {"name": "e"}})).endswith("sub/x.db")


def test_local_artifacts_go_next_to_the_database():
    assert artifact_location("sqlite:////data/mlflow.db", "my exp/1") == "/data/mlartifacts/my_exp_1"
    assert artifact_location("http://mlflow:5000", "e") is None


def test_unreachable_server_fails_fast_with_the_uri():
    uri = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(TrackingError, match="not reachable") as info:
        check_tracking_uri(uri)
    assert uri in str(info.value)
    assert time.monotonic() - start < 5


def test_server_that_never_answers_fails_within_the_probe_timeout():
    with socket.socket() as silent:  # accepts connections (kernel backlog) but never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(TrackingError, match="not reachable"):
            check_tracking_uri(uri, timeout_s=0.5)
        assert time.monotonic() - start < 5


def test_sqlite_in_a_missing_directory_is_reported(tmp_path):
    with pytest.raises(TrackingError, match="does not exist"):
        check_tracking_uri(f"sqlite:///{tmp_path}/nope/mlflow.db")
    check_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")


# --- trackers ---------------------------------------------------------------------------------------


def test_null_tracker_accepts_everything(tmp_path):
    with NullTracker() as tracker:
        tracker.log_metrics({"a": 1.0}, step=0)
        tracker.log_params({"p": 1})
        tracker.set_tags({"t": "x"})
        tracker.log_artifact(tmp_path / "missing")
        tracker.log_artifacts(tmp_path)
        tracker.log_dict({"a": 1}, "a.json")
        tracker.log_text("x", "x.txt")
    assert tracker.logging_s == 0.0


# --- run tree ---------------------------------------------------------------------------------------


def test_unreachable_server_fails_before_any_run(monkeypatch):
    recipe = make_recipe(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(TrackingError, match="not reachable"), parent_run(recipe, flow_run_id="f", run_name="p"):
        pytest.fail("body must not run")
