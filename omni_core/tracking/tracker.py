"""Trackers: what training and flows log through. `MlflowTracker` never makes a training step wait for
MLflow: metrics are queued and a background thread sends them with `log_batch`. `NullTracker` lets
non-zero ranks and offline runs run the exact same code."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from omni_core.tracking.store import TrackingError, mlflow_client, resolve_tracking_uri

log = logging.getLogger("omni.tracking")

# MLflow's limits (mlflow.utils.validation), copied so that importing this module stays free of MLflow.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_KEY_LENGTH = 250
SPOOL_FILE = "unsent_metrics.jsonl"  # beside a launch's result: what rank 0 could not send
MAX_BUFFERED = 100_000  # metrics queued while the server is away (~20 MB); the oldest dropped past it
TRUNCATED = "...[truncated]"

T = TypeVar("T")


class Tracker(Protocol):
    """`logging_s` / `logging_calls`: time spent inside the tracker's calls on the caller's thread (queueing
    metrics, synchronous params/tags/artifacts, the final flush in close()), so the trainer can report
    logging overhead as a share of step time."""

    logging_s: float
    logging_calls: int

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_artifacts(self, directory: str | Path, artifact_path: str | None = None) -> None: ...
    def log_dict(self, obj: Any, file: str) -> None: ...
    def log_text(self, text: str, file: str) -> None: ...
    def close(self) -> None: ...


_ILLEGAL = re.compile(r"[^A-Za-z0-9_.\-/]")


@functools.lru_cache(maxsize=4096)  # the same few keys every step
def sanitize_metric_name(name: str) -> str:
    """An MLflow-legal key that keeps `/` grouping (`train/loss`): other characters become `_`, and no
    segment is empty, `.` or `..` (MLflow rejects keys that would resolve to another path)."""
    parts = [_ILLEGAL.sub("_", p) for p in str(name).split("/") if p]
    parts = ["_" if p in (".", "..") else p for p in parts]
    return ("/".join(parts) or "_")[:MAX_KEY_LENGTH]


def _truncate(value: Any, limit: int) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - len(TRUNCATED)] + TRUNCATED


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _timed(method: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.logging_s += time.perf_counter() - start
            self.logging_calls += 1

    return wrapper


class NullTracker:
    """Accepts everything, sends nothing."""

    logging_s = 0.0
    logging_calls = 0

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_artifacts(self, directory: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_dict(self, obj: Any, file: str) -> None:
        pass

    def log_text(self, text: str, file: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MlflowTracker:
    """Logs into one existing MLflow run.

    Metrics: queued by `log_metrics` (microseconds), sent by a daemon thread at most every `flush_every_s`
    and on `close()`, `log_batch` of <= 1000 each, in call order. A server that cannot be reached (or answers
    5xx) delays nothing: its metrics stay queued, up to `MAX_BUFFERED`, and go out once it answers again (one
    warning per outage, retries backing off to 30 s). `close()` waits at most `close_timeout_s` for the queue
    to drain; what is still queued then is written to `spool` (JSON lines a later process replays with
    `replay_spool`) or, without one, counted as lost. A batch the server refuses (4xx) is lost at once. Loss
    is warned about and counted in `lost_metrics`, never raised: a finished training must not fail for it.
    Params and tags: sent at once, <= 100 per call, values cut to MLflow's limits with a marker.
    """

    def __init__(
        self,
        run_id: str,
        uri: str | None = None,
        flush_every_s: float = 2.0,
        *,
        close_timeout_s: float = 60.0,
        spool: Path | None = None,
        experiment_id: str | None = None,
    ):
        self.run_id = run_id
        self.experiment_id = experiment_id  # where the run is browsed (tracking.ui), when its creator knows it
        self.uri = uri or resolve_tracking_uri()
        self.flush_every_s = flush_every_s
        self.close_timeout_s = close_timeout_s
        self.spool = spool
        self.logging_s = 0.0
        self.logging_calls = 0
        self.failed_batches = 0
        self.lost_metrics = 0
        self.spooled_metrics = 0
        self._unreachable_since: float | None = None
        self._client = mlflow_client(self.uri)
        from mlflow.entities import Metric, Param, RunTag

        self._metric, self._param, self._tag = Metric, Param, RunTag
        self._pending: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name=f"mlflow-metrics-{run_id[:8]}", daemon=True)
        self._sender.start()

    @_timed
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._closed:
            raise TrackingError(f"tracker for MLflow run {self.run_id} is closed")
        now = int(time.time() * 1000)
        batch = [self._metric(sanitize_metric_name(k), float(v), now, int(step)) for k, v in metrics.items()]
        with self._lock:
            self._pending.extend(batch)

    @_timed
    def log_params(self, params: Mapping[str, Any]) -> None:
        items = [self._param(sanitize_metric_name(k), _truncate(v, MAX_PARAM_VAL_LENGTH)) for k, v in params.items()]
        for chunk in _chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=chunk)

    @_timed
    def set_tags(self, tags: Mapping[str, Any]) -> None:
        items = [self._tag(k, _truncate(v, MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]
        for chunk in _chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, tags=chunk)

    @_timed
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._client.log_artifact(self.run_id, str(path), artifact_path)

    @_timed
    def log_artifacts(self, directory: str | Path, artifact_path: str | None = None) -> None:
        self._client.log_artifacts(self.run_id, str(directory), artifact_path)

    @_timed
    def log_dict(self, obj: Any, file: str) -> None:
        self._client.log_dict(self.run_id, obj, file)

    @_timed
    def log_text(self, text: str, file: str) -> None:
        self._client.log_text(self.run_id, text, file)

    @_timed
    def close(self) -> None:
        """Send what is queued (waiting at most `close_timeout_s` for a server that is away), stop the thread,
        spool or count what could not be sent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._sender.join()
        with self._lock:
            unsent, self._pending = self._pending, []
        if unsent and self.spool is not None:
            with open(self.spool, "a") as out:
                out.writelines(
                    json.dumps({"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step}) + "\n"
                    for m in unsent
                )
            self.spooled_metrics += len(unsent)
            log.warning(
                "MLflow run %s: %d metrics not sent to %s (unreachable); kept in %s",
                self.run_id,
                len(unsent),
                self.uri,
                self.spool,
            )
        elif unsent:
            self.lost_metrics += len(unsent)
        if self.lost_metrics:
            log.warning(
                "MLflow run %s: %d metrics lost (%d batches refused by %s)",
                self.run_id,
                self.lost_metrics,
                self.failed_batches,
                self.uri,
            )

    def __enter__(self) -> MlflowTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send_loop(self) -> None:
        """Flush every `flush_every_s`, backing off while the server is away; once close() asks, keep trying
        until the queue is empty or `close_timeout_s` has passed."""
        wait, deadline = self.flush_every_s, None
        while True:
            if deadline is None:
                if self._stop.wait(wait):
                    deadline = time.monotonic() + self.close_timeout_s
            else:
                time.sleep(min(wait, max(deadline - time.monotonic(), 0.0)))
            sent = self._flush()
            if deadline is not None and (sent or time.monotonic() >= deadline):
                return
            wait = self.flush_every_s if sent else min(max(2 * wait, 0.5), 30.0)

    def _flush(self) -> bool:
        """Send the queue; True when nothing is left queued (sent, or refused and counted)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for start in range(0, len(pending), MAX_METRICS_PER_BATCH):
            chunk = pending[start : start + MAX_METRICS_PER_BATCH]
            try:
                self._client.log_batch(self.run_id, metrics=chunk, synchronous=True)
            except Exception as e:  # a thread must not die quietly: kept for later, or counted and warned
                if not _unreachable(e):
                    self.failed_batches += 1
                    self.lost_metrics += len(chunk)
                    log.warning("MLflow run %s: %d metrics refused: %s", self.run_id, len(chunk), e)
                    continue
                self._requeue(pending[start:], e)
                return False
        if self._unreachable_since is not None:
            log.warning(
                "MLflow at %s answers again after %.0f s; queued metrics sent",
                self.uri,
                time.monotonic() - self._unreachable_since,
            )
            self._unreachable_since = None
        return True

    def _requeue(self, unsent: list[Any], error: BaseException) -> None:
        with self._lock:
            self._pending[:0] = unsent
            dropped = len(self._pending) - MAX_BUFFERED
            if dropped > 0:  # the oldest go first
                del self._pending[:dropped]
                self.lost_metrics += dropped
        if self._unreachable_since is None:
            self._unreachable_since = time.monotonic()
            log.warning(
                "MLflow at %s unreachable (%s): metrics are queued and sent when it answers",
                self.uri,
                str(error).splitlines()[0][:200],
            )


def _unreachable(error: BaseException) -> bool:
    """A server that is away or failing (connection refused, timeout, 5xx), as opposed to one that refuses."""
    status = getattr(error, "get_http_status_code", None)
    return status is None or status() >= 500


def replay_spool(run: MlflowTracker, spool: Path) -> int:
    """Log the metrics a tracker could not send (`MlflowTracker.spool`) into `run`, then remove the file;
    the number replayed."""
    if not spool.is_file():
        return 0
    lines = [json.loads(line) for line in spool.read_text().splitlines() if line.strip()]
    metrics = [run._metric(m["key"], m["value"], m["timestamp"], m["step"]) for m in lines]
    for chunk in _chunks(metrics, MAX_METRICS_PER_BATCH):
        run._client.log_batch(run.run_id, metrics=chunk, synchronous=True)
    spool.unlink()
    return len(metrics)


# Rank 0 waits at most this long at the end for a server that is away (never longer than the recipe's
# tracking.reconnect_timeout_s), then spools: the launching train stage waits for the server and replays the
# spool, so every rank need not wait too.
RANK_CLOSE_TIMEOUT_S = 10.0
RANK_HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def _bound_http_calls() -> None:
    """Each MLflow HTTP call of a training process bounded (`RANK_HTTP_LIMITS`, unless the environment sets
    them): MLflow's own retries would hold a call for minutes, and the tracker retries on its own."""
    for key, value in RANK_HTTP_LIMITS.items():
        os.environ.setdefault(key, value)


def tracker_for_rank(
    rank: int, flush_every_s: float = 2.0, spool: Path | None = None, reconnect_timeout_s: float = RANK_CLOSE_TIMEOUT_S
) -> Tracker:
    """The trainer's tracker: rank 0 logs into $MLFLOW_RUN_ID (set by the launching flow); everyone else,
    and runs without a flow around them, get a NullTracker."""
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if rank != 0 or not run_id:
        return NullTracker()
    _bound_http_calls()
    return MlflowTracker(
        run_id,
        resolve_tracking_uri(),
        flush_every_s,
        spool=spool,
        close_timeout_s=min(RANK_CLOSE_TIMEOUT_S, reconnect_timeout_s),
    )


@contextmanager
def system_metrics(node: int, sampling_s: float = 10.0) -> Iterator[None]:
    """MLflow's system metrics (CPU, memory, disk, network; GPUs where NVML is installed) of this node into the
    run $MLFLOW_RUN_ID, as `system/node<node>/...`, while the block runs; nothing without a run."""
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        yield
        return
    _bound_http_calls()
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        run_id, sampling_interval=sampling_s, node_id=f"node{node}", tracking_uri=resolve_tracking_uri()
    )
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()
