"""What a running training job and the watcher that may re-plan it say to each other, through two small files
in the job's control folder (`$OMNI_CONTROL_DIR`, set by whoever launches the job).

- `progress.json` (`TrainProgress`): rank 0 rewrites it at every log step, so a watcher knows where the job is
  in its data stream and what its steps and restarts cost.
- `stop.json` (`StopRequest`): written by a watcher; at its next checkpoint the job reads it (rank 0, the
  answer broadcast), stops there with the checkpoint saved, and leaves it for its launcher, which relaunches
  the job under the request's overrides.

Files rather than a socket: either side may be restarted, and a watcher may run on another machine that shares
the folder. Each is written whole and renamed into place (`Result.save`).
"""

from __future__ import annotations

import os
from pathlib import Path

from omni_core.common.results import Result

CONTROL_ENV = "OMNI_CONTROL_DIR"
LAUNCHED_ENV = "OMNI_LAUNCHED_UNIX"  # when the launcher started the job: its startup counts from there
PROGRESS_FILE = "progress.json"
STOP_FILE = "stop.json"


class TrainProgress(Result):
    step: int  # steps done
    steps: int  # train.steps
    plan: str
    samples: int  # samples consumed over all data ranks, resumes included (where a file source's stream is)
    step_s: float  # mean seconds per step since the last log step
    startup_s: float  # this launch: seconds from its launcher's start (processes, build, restore) to its first step
    ckpt_s: float  # seconds the last checkpoint took to save (0 before the first)
    resumed_from_step: int
    updated_unix: float


class StopRequest(Result):
    """Stop at the next checkpoint after `after_step` and relaunch under `overrides` (recipe `--set` values)."""

    after_step: int
    plan: str  # the plan the relaunch runs
    overrides: list[str]
    reason: str


def launched_unix() -> float | None:
    value = os.environ.get(LAUNCHED_ENV, "")
    return float(value) if value else None


def control_dir() -> Path | None:
    """The job's control folder, when its launcher gave one."""
    value = os.environ.get(CONTROL_ENV, "")
    return Path(value) if value else None


def read_progress(folder: Path) -> TrainProgress | None:
    path = folder / PROGRESS_FILE
    return TrainProgress.load(path) if path.is_file() else None


def read_stop(folder: Path) -> StopRequest | None:
    path = folder / STOP_FILE
    return StopRequest.load(path) if path.is_file() else None


def clear_stop(folder: Path) -> None:
    (folder / STOP_FILE).unlink(missing_ok=True)
