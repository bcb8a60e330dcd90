"""What omni could not tell an MLflow server because it was away: a run's final status (and tags) and the
metrics a training spooled. They are kept in one file per user ($OMNI_HOME, default ~/.omni) and settled
by the next omni process that opens a run on that server, so no run is left RUNNING for good and no spooled
metric is forgotten in a run folder."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omni_core.tracking.store import TrackingError, check_tracking_uri, mlflow_client
from omni_core.tracking.tracker import MlflowTracker, replay_spool

log = logging.getLogger("omni.tracking")
PENDING_FILE = "pending_tracking.jsonl"


def pending_path() -> Path:
    return Path(os.environ.get("OMNI_HOME") or Path.home() / ".omni") / PENDING_FILE


def defer_finish(uri: str, run_id: str, status: str, tags: dict[str, str]) -> None:
    """Record that `run_id` ended with `status` (now) and `tags`, to be set when `uri` answers again."""
    _append(
        {
            "uri": uri,
            "run_id": run_id,
            "kind": "finish",
            "status": status,
            "end_time": int(time.time() * 1000),
            "tags": tags,
        }
    )


def defer_replay(uri: str, run_id: str, spool: Path) -> None:
    """Record that the metrics in `spool` still have to reach `run_id`."""
    _append({"uri": uri, "run_id": run_id, "kind": "replay", "spool": str(spool.resolve())})


def replay_when_reachable(run: MlflowTracker, spool: Path, wait_s: float) -> int | None:
    """Replay `spool` into `run` once its server answers, waiting at most `wait_s` (backing off to 10 s) for
    one that is away; the number replayed, or None when it stayed away (the spool is then pending)."""
    deadline, pause = time.monotonic() + wait_s, 0.5
    while True:
        try:
            check_tracking_uri(run.uri)
            return replay_spool(run, spool)
        except TrackingError:
            if time.monotonic() + pause > deadline:
                break
        except Exception as error:
            log.warning("%s not replayed into MLflow run %s: %s", spool, run.run_id, error)
            break
        time.sleep(pause)
        pause = min(2 * pause, 10.0)
    if spool.is_file():
        defer_replay(run.uri, run.run_id, spool)
    return None


def pending(uri: str | None = None) -> list[dict[str, Any]]:
    """The entries waiting (for `uri`, or every server)."""
    path = pending_path()
    if not path.is_file():
        return []
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in entries if uri is None or e["uri"] == uri]


def settle(uri: str) -> int:
    """Carry out every entry for `uri` (a server that answers): spooled metrics first, then final statuses.
    An entry that fails again stays for the next time. Returns how many were settled."""
    if not pending_path().is_file():
        return 0
    with _locked():
        entries = pending()
        mine = sorted((e for e in entries if e["uri"] == uri), key=lambda e: e["kind"] != "replay")
        kept = [e for e in entries if e["uri"] != uri]
        failed = []
        for entry in mine:
            try:
                _carry_out(entry)
            except Exception as error:
                log.warning("MLflow run %s: pending %s not settled yet: %s", entry["run_id"], entry["kind"], error)
                failed.append(entry)
        _rewrite(kept + failed)
    settled = len(mine) - len(failed)
    if settled:
        log.warning("settled %d tracking entries left while %s was unreachable", settled, uri)
    return settled


def _carry_out(entry: dict[str, Any]) -> None:
    if entry["kind"] == "replay":
        spool = Path(entry["spool"])
        tracker = MlflowTracker(entry["run_id"], entry["uri"])
        try:
            replay_spool(tracker, spool)
        finally:
            tracker.close()
        return
    client = mlflow_client(entry["uri"])
    for key, value in entry["tags"].items():
        client.set_tag(entry["run_id"], key, value)
    client.set_terminated(entry["run_id"], entry["status"], end_time=entry["end_time"])


def _append(entry: dict[str, Any]) -> None:
    with _locked(), open(pending_path(), "a") as out:
        out.write(json.dumps(entry) + "\n")


def _rewrite(entries: list[dict[str, Any]]) -> None:
    path = pending_path()
    if not entries:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in entries))
    tmp.replace(path)


@contextmanager
def _locked() -> Iterator[None]:
    """One omni process at a time reads or changes the file (two settling at once would replay twice)."""
    path = pending_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
