"""The MLflow run tree of a flow run: one parent run per experiment flow run, one child run per stage.

The current parent lives in a context variable set by `parent_run`, so stage subflows find it without
taking a run id parameter: their parameters stay `recipe + overrides`, and a stage run alone
(`omni train`) simply becomes a top-level run.
"""

from __future__ import annotations

import functools
import logging
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING

from omni_core import recipe as recipes
from omni_core.tracking.pending import defer_finish, pending_path, settle
from omni_core.tracking.store import (
    TrackingError,
    artifact_location,
    check_tracking_uri,
    mlflow_client,
    resolve_tracking_uri,
)
from omni_core.tracking.tracker import MlflowTracker

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from omni_core.recipe import Recipe


log = logging.getLogger("omni.tracking")
PARENT_TAG = "mlflow.parentRunId"  # what the MLflow UI nests child runs by
_parent_run_id: ContextVar[str | None] = ContextVar("omni_parent_run_id", default=None)


def current_parent_run_id() -> str | None:
    return _parent_run_id.get()


@functools.cache
def git_sha() -> str:
    """Commit of the omni code that is running ('unknown' outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


# MLflow 3 opens an experiment on the view of its kind: omni's are model training, not GenAI traces
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}


def _experiment_id(client: MlflowClient, name: str, uri: str) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location(uri, name), tags=EXPERIMENT_TAGS)
        except MlflowException as e:  # another process created it in between
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = client.get_experiment_by_name(name)
            if experiment is None:  # removed for good again before this process could read it
                raise TrackingError(
                    f"MLflow experiment {name!r} at {uri} was created by another process, then could not be found"
                ) from e
    if experiment.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow experiment {name!r} (id {experiment.experiment_id}) at {uri} is deleted: restore it with "
            f"`mlflow experiments restore --experiment-id {experiment.experiment_id}` or set tracking.experiment."
        )
    if experiment.artifact_location.startswith("mlflow-artifacts:") and not uri.startswith("http"):
        raise TrackingError(  # created through `mlflow ui`/server: only that server can store its artifacts
            f"MLflow experiment {name!r} keeps artifacts behind a tracking server ({experiment.artifact_location}), "
            f"but omni is tracking to {uri}: set MLFLOW_TRACKING_URI to that server, or use another experiment name."
        )
    if not experiment.tags.keys() & EXPERIMENT_TAGS.keys():  # made before omni tagged its kind, or by hand
        for key, value in EXPERIMENT_TAGS.items():
            client.set_experiment_tag(experiment.experiment_id, key, value)
    return experiment.experiment_id


@contextmanager
def _run(recipe: Recipe, name: str, flow_run_id: str, parent_id: str | None) -> Iterator[MlflowTracker]:
    """A run that ends FINISHED, FAILED (the body raised) or KILLED (interrupted); metrics its tracker lost are
    counted in the tag `omni.lost_metrics`. A server away at the end gets the status later (`pending`); one
    that answers now first gets what earlier runs left pending.
    A root run carries the recipe: flattened as params and resolved as recipe.yaml."""
    uri = resolve_tracking_uri(recipe)
    check_tracking_uri(uri)
    settle(uri)
    client = mlflow_client(uri)
    tags = {"prefect.flow_run_id": flow_run_id, "git.sha": git_sha(), "recipe.hash": recipes.recipe_hash(recipe)}
    if parent_id:
        tags[PARENT_TAG] = parent_id
    run = client.create_run(_experiment_id(client, recipe.mlflow_experiment(), uri), run_name=name, tags=tags)
    tracker = MlflowTracker(run.info.run_id, uri, recipe.tracking.flush_every_s, experiment_id=run.info.experiment_id)
    error: BaseException | None = None
    try:
        if parent_id is None:
            tracker.log_params(recipes.flatten_recipe(recipe))
            tracker.log_text(recipes.dump_recipe(recipe), "recipe.yaml")
        yield tracker
    except BaseException as e:
        error = e
        raise
    finally:
        status = "FINISHED" if error is None else "FAILED" if isinstance(error, Exception) else "KILLED"
        tracker.close()
        _finish(client, uri, run.info.run_id, status, tracker.lost_metrics)


def _finish(client: MlflowClient, uri: str, run_id: str, status: str, lost_metrics: int) -> None:
    """End the run on the server, or, when it is unreachable, record the end for a later omni process: a run
    is never left RUNNING because the server was away when it ended."""
    tags = {"omni.lost_metrics": str(lost_metrics)} if lost_metrics else {}
    try:
        check_tracking_uri(uri)
    except TrackingError as away:
        defer_finish(uri, run_id, status, tags)
        log.warning(
            "%s\nMLflow run %s ended %s: kept in %s and set when omni next reaches the server",
            away,
            run_id,
            status,
            pending_path(),
        )
        return
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    client.set_terminated(run_id, status)


@contextmanager
def parent_run(recipe: Recipe, *, flow_run_id: str, run_name: str) -> Iterator[MlflowTracker]:
    """The root run of one experiment flow run; stage runs opened inside it become its children."""
    with _run(recipe, run_name, flow_run_id, parent_id=None) as tracker, children_of(tracker.run_id):
        yield tracker


@contextmanager
def children_of(run_id: str | None) -> Iterator[None]:
    """Stage runs opened inside become children of `run_id` (the schedule stage nests its jobs' train runs);
    None: top-level runs."""
    token = _parent_run_id.set(run_id)
    try:
        yield
    finally:
        _parent_run_id.reset(token)


@contextmanager
def stage_run(name: str, recipe: Recipe, *, flow_run_id: str) -> Iterator[MlflowTracker]:
    """A run named `name`: a child of the current parent run, or a top-level run when there is none."""
    with _run(recipe, name, flow_run_id, parent_id=current_parent_run_id()) as tracker:
        yield tracker


def log_to_run(run_id: str, uri: str, metrics: dict[str, float], *, step: int) -> None:
    """Metrics into a run opened elsewhere (the parent, a finished look), sent before this returns."""
    tracker = MlflowTracker(run_id, uri)
    try:
        tracker.log_metrics(metrics, step=step)
    finally:
        tracker.close()
