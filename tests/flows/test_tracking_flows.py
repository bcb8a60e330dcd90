"""omni_core.tracking on the session's sqlite MLflow store: trackers (batched/async, failures surfaced) and the run
tree."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import pytest

from omni_core.recipe import recipe_hash
from omni_core.tracking import (
    MlflowTracker,
    NullTracker,
    TrackingError,
    current_parent_run_id,
    parent_run,
    stage_run,
    tracker_for_rank,
)
from omni_core.tracking.tracker import RANK_CLOSE_TIMEOUT_S
from tests.helpers.recipes import build_recipe
from tests.helpers.tracking import tracking_to


@pytest.fixture
def client(mlflow_store):
    from mlflow import MlflowClient

    return MlflowClient(mlflow_store)


@pytest.fixture
def run_id(client) -> str:
    experiment = client.create_experiment(f"t-{uuid.uuid4().hex[:8]}")
    return client.create_run(experiment).info.run_id


# --- trackers ---------------------------------------------------------------------------------------


def test_more_than_100_params_are_all_logged_and_long_values_truncated(client, run_id, mlflow_store):
    params = {f"p.{i:03d}": i for i in range(250)}
    params["long"] = "v" * 7000
    with MlflowTracker(run_id, mlflow_store) as tracker:
        tracker.log_params(params)
        tracker.set_tags({"note": "t" * 9000})
    run = client.get_run(run_id)
    assert len(run.data.params) == 251
    assert run.data.params["p.249"] == "249"
    assert len(run.data.params["long"]) == 6000 and run.data.params["long"].endswith("[truncated]")
    assert len(run.data.tags["note"]) == 8000


def test_metrics_are_queued_then_all_sent_in_step_order_in_batches(client, run_id, mlflow_store):
    tracker = MlflowTracker(run_id, mlflow_store, flush_every_s=60)  # nothing leaves before close()
    sent: list[int] = []
    log_batch = tracker._client.log_batch

    def spy(*args, **kwargs):
        sent.append(len(kwargs.get("metrics", ())))
        return log_batch(*args, **kwargs)

    tracker._client.log_batch = spy
    for step in range(1250):
        tracker.log_metrics({"train/loss": 10 - step / 1000, "perf/tokens per s": step}, step=step)
    time.sleep(0.2)
    assert client.get_metric_history(run_id, "train/loss") == []
    tracker.close()
    assert sent == [1000, 1000, 500]
    history = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in history] == list(range(1250))
    assert history[-1].value == pytest.approx(10 - 1.249)
    assert len(client.get_metric_history(run_id, "perf/tokens_per_s")) == 1250
    assert tracker.logging_calls == 1251 and tracker.logging_s > 0


def test_metrics_are_flushed_periodically(client, run_id, mlflow_store):
    with MlflowTracker(run_id, mlflow_store, flush_every_s=0.05) as tracker:
        tracker.log_metrics({"a": 1.0}, step=1)
        deadline = time.monotonic() + 10
        while not client.get_metric_history(run_id, "a") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [m.value for m in client.get_metric_history(run_id, "a")] == [1.0]


def test_refused_batches_are_warned_about_and_counted_never_raised(mlflow_store, caplog):
    tracker = MlflowTracker("0" * 32, mlflow_store, flush_every_s=0.05)  # no such run: the store refuses
    with caplog.at_level(logging.WARNING, logger="omni.tracking"):
        tracker.log_metrics({"a": 1.0, "b": 2.0}, step=0)
        tracker.close()
    assert tracker.lost_metrics == 2 and tracker.failed_batches == 1
    assert "2 metrics refused" in caplog.text and "2 metrics lost" in caplog.text
    with pytest.raises(TrackingError, match="closed"):
        tracker.log_metrics({"a": 1.0}, step=1)


class _AwayThenBack:
    """A client whose server is unreachable (MLflow's 500 for a refused connection) for `away` calls."""

    def __init__(self, client, away: int):
        self.client, self.away, self.calls = client, away, 0

    def log_batch(self, *args, **kwargs):
        from mlflow.exceptions import MlflowException

        self.calls += 1
        if self.calls <= self.away:
            raise MlflowException("API request failed with exception HTTPConnectionPool: Max retries exceeded")
        return self.client.log_batch(*args, **kwargs)


def test_metrics_wait_for_a_server_that_went_away_and_arrive_in_order(mlflow_store, run_id, client, caplog):
    tracker = MlflowTracker(run_id, mlflow_store, flush_every_s=0.05)
    tracker._client = _AwayThenBack(tracker._client, away=4)
    with caplog.at_level(logging.WARNING, logger="omni.tracking"):
        for step in range(1, 6):
            tracker.log_metrics({"a": float(step)}, step=step)  # never blocks on the server
            time.sleep(0.05)
        tracker.close()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "a")] == [(s, float(s)) for s in range(1, 6)]
    assert tracker.lost_metrics == 0
    assert caplog.text.count("unreachable") == 1 and "answers again" in caplog.text


@pytest.mark.timeout(60)  # a hang guard: close() must give up after close_timeout_s, never retry for good
def test_what_close_cannot_send_is_spooled_and_replayed_later(mlflow_store, run_id, client, tmp_path):
    from omni_core.tracking import replay_spool

    spool = tmp_path / "unsent.jsonl"
    tracker = MlflowTracker(run_id, mlflow_store, flush_every_s=0.05, close_timeout_s=0.3, spool=spool)
    tracker._client = away = _AwayThenBack(tracker._client, away=10**6)  # away for good
    tracker.log_metrics({"a": 1.0, "b": 2.0}, step=3)
    tracker.close()
    assert away.calls >= 1  # it tried, then spooled rather than waiting for the server
    assert tracker.spooled_metrics == 2 and tracker.lost_metrics == 0
    with MlflowTracker(run_id, mlflow_store) as later:
        assert replay_spool(later, spool) == 2 and not spool.exists()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "b")] == [(3, 2.0)]


def test_pending_ends_and_spools_are_settled_once_and_failures_kept(mlflow_store, run_id, client, tmp_path,
                                                                    monkeypatch):
    from omni_core.tracking import pending, settle
    from omni_core.tracking.pending import defer_finish, defer_replay, pending_path

    monkeypatch.setenv("OMNI_HOME", str(tmp_path / "home"))
    spool = tmp_path / "unsent.jsonl"
    spool.write_text('{"key": "train/loss", "value": 1.5, "timestamp": 1000, "step": 7}\n')
    defer_finish(mlflow_store, run_id, "FINISHED", {"omni.lost_metrics": "3"})
    defer_replay(mlflow_store, run_id, spool)
    defer_finish(mlflow_store, "0" * 32, "FAILED", {})  # a run the server does not know: stays pending
    defer_finish("http://127.0.0.1:9", run_id, "FAILED", {})  # another server's: untouched
    assert settle(mlflow_store) == 2
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["omni.lost_metrics"] == "3"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(7, 1.5)]
    assert not spool.exists()
    assert [(e["uri"], e["run_id"]) for e in pending()] == [("http://127.0.0.1:9", run_id), (mlflow_store, "0" * 32)]
    assert settle(mlflow_store) == 0 and pending_path().is_file()


def test_tracker_for_rank(monkeypatch, mlflow_uri, run_id):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    assert isinstance(tracker_for_rank(0), NullTracker)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    assert isinstance(tracker_for_rank(1), NullTracker)
    tracker = tracker_for_rank(0, flush_every_s=0.5)
    assert isinstance(tracker, MlflowTracker)
    assert (tracker.run_id, tracker.uri, tracker.flush_every_s) == (run_id, mlflow_uri, 0.5)
    tracker.close()
    # a recipe that waits less for an away server than rank 0 would by itself bounds rank 0's wait too
    assert tracker.close_timeout_s == RANK_CLOSE_TIMEOUT_S
    impatient = tracker_for_rank(0, reconnect_timeout_s=2.0)
    assert impatient.close_timeout_s == 2.0
    impatient.close()


# --- run tree ---------------------------------------------------------------------------------------


def test_stage_runs_are_children_of_the_parent_run(client, mlflow_store):
    recipe = build_recipe(overrides=tracking_to(mlflow_store))
    with parent_run(recipe, flow_run_id="flow-1", run_name="p") as parent:
        assert current_parent_run_id() == parent.run_id
        with stage_run("profile", recipe, flow_run_id="flow-2") as profile:
            profile.log_metrics({"profile/samples": 60}, step=0)
        with pytest.raises(ValueError), stage_run("train", recipe, flow_run_id="flow-3") as train:
            raise ValueError("boom")
    assert current_parent_run_id() is None

    p = client.get_run(parent.run_id)
    assert p.info.status == "FINISHED" and p.info.run_name == "p"
    assert p.data.tags["prefect.flow_run_id"] == "flow-1"
    assert p.data.tags["recipe.hash"] == recipe_hash(recipe)
    assert p.data.tags["git.sha"]
    assert p.data.params["train.steps"] == str(recipe.train.steps)
    assert [a.path for a in client.list_artifacts(parent.run_id)] == ["recipe.yaml"]
    db_dir = Path(mlflow_store.removeprefix("sqlite:///")).parent
    assert p.info.artifact_uri.removeprefix("file://").startswith(str(db_dir / "mlartifacts" / recipe.experiment.name))

    found = client.search_runs([p.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.run_id}'")
    children = {r.info.run_name: r for r in found}
    assert set(children) == {"profile", "train"}
    assert children["profile"].info.status == "FINISHED"
    assert children["profile"].data.metrics["profile/samples"] == 60
    assert children["profile"].data.tags["prefect.flow_run_id"] == "flow-2"
    assert children["train"].info.status == "FAILED"
    assert children["train"].info.run_id == train.run_id
    assert children["train"].data.params == {}  # the recipe lives on the root run


def test_stage_run_alone_is_a_top_level_run_with_the_recipe(client, mlflow_store):
    recipe = build_recipe(overrides=tracking_to(mlflow_store))
    with stage_run("evaluate", recipe, flow_run_id="flow-9") as run:
        pass
    r = client.get_run(run.run_id)
    assert "mlflow.parentRunId" not in r.data.tags
    assert r.info.run_name == "evaluate" and r.info.status == "FINISHED"
    assert r.data.params["experiment.name"] == recipe.experiment.name
    assert client.get_experiment(r.info.experiment_id).name == recipe.mlflow_experiment()


def test_interrupted_run_is_marked_killed(client, mlflow_store):
    recipe = build_recipe(overrides=tracking_to(mlflow_store))
    with pytest.raises(KeyboardInterrupt), parent_run(recipe, flow_run_id="f", run_name="p") as run:
        raise KeyboardInterrupt
    assert client.get_run(run.run_id).info.status == "KILLED"


def test_experiment_made_by_a_tracking_server_needs_that_server(client, mlflow_store):
    recipe = build_recipe(overrides=tracking_to(mlflow_store))
    client.create_experiment(recipe.experiment.name, artifact_location="mlflow-artifacts:/7")
    with pytest.raises(TrackingError, match="MLFLOW_TRACKING_URI"), stage_run("profile", recipe, flow_run_id="f"):
        pytest.fail("body must not run")


def test_deleted_experiment_is_reported_with_how_to_restore(client, mlflow_store):
    recipe = build_recipe(overrides=tracking_to(mlflow_store))
    client.delete_experiment(client.create_experiment(recipe.experiment.name))
    with pytest.raises(TrackingError, match="is deleted.*mlflow experiments restore"), parent_run(
        recipe, flow_run_id="f", run_name="p"
    ):
        pytest.fail("body must not run")
