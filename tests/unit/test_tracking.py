"""omni_core.tracking without a store: URIs and health check, the null tracker, a run refused before it starts
(trackers and the run tree on a sqlite store: tests/flows/test_tracking_flows.py)."""

from __future__ import annotations

import socket

import pytest

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
from omni_core.tracking.store import HEALTH_TIMEOUT_S
from tests.helpers.recipes import build_recipe
from tests.helpers.tracking import tracking_to

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
    assert resolve_tracking_uri(build_recipe(overrides={"tracking.uri": "http://mlflow:5000"})) == "http://mlflow:5000"
    assert resolve_tracking_uri(build_recipe()).endswith("sub/x.db")


def test_local_artifacts_go_next_to_the_database():
    assert artifact_location("sqlite:////data/mlflow.db", "my exp/1") == "/data/mlartifacts/my_exp_1"
    assert artifact_location("http://mlflow:5000", "e") is None


@pytest.fixture
def health_probes(monkeypatch) -> list[tuple[str, float | None]]:
    """Every request `check_tracking_uri` sends, as (URL, timeout); each still goes out for real."""
    import urllib.request

    sent: list[tuple[str, float | None]] = []
    urlopen = urllib.request.urlopen

    def recording(url, *args, **kwargs):
        sent.append((url, kwargs.get("timeout")))
        return urlopen(url, *args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", recording)
    return sent


@pytest.mark.timeout(60)  # a hang guard: MLflow's own client would retry for minutes
def test_unreachable_server_fails_fast_with_the_uri(health_probes):
    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TrackingError, match="not reachable") as info:
        check_tracking_uri(uri)
    assert uri in str(info.value)
    assert health_probes == [(f"{uri}/health", HEALTH_TIMEOUT_S)]  # one probe, bounded, never retried


@pytest.mark.timeout(60)
def test_server_that_never_answers_fails_within_the_probe_timeout(health_probes):
    with socket.socket() as silent:  # accepts connections (kernel backlog) but never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(TrackingError, match="not reachable"):
            check_tracking_uri(uri, timeout_s=0.5)
        assert health_probes == [(f"{uri}/health", 0.5)]


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
    recipe = build_recipe(overrides=tracking_to(f"http://127.0.0.1:{free_port()}"))
    with pytest.raises(TrackingError, match="not reachable"), parent_run(recipe, flow_run_id="f", run_name="p"):
        pytest.fail("body must not run")
