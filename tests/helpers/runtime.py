"""The one CPU process, a tracker that keeps what the trainer logs, and a launched worker's pid: the
runtime tests share them (in one process, under torchrun, from a flow, and against an S3 server)."""

from __future__ import annotations

from pathlib import Path

import torch

from omni_core.runtime.dist import DistInfo
from omni_core.tracking import NullTracker

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


class RecordingTracker(NullTracker):
    """Keeps what the trainer logs, so tests can read per-step losses."""

    def __init__(self) -> None:
        self.metrics: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics, step=None):  # noqa: D102 - protocol method
        self.metrics.setdefault(step, {}).update(metrics)


def worker_pid(fragment: str, local_rank: int) -> int | None:
    """The pid of a training worker (`omni_core.runtime.launch`, not torchrun itself) whose command line holds
    `fragment` (its recipe's path, or a folder above it) and whose LOCAL_RANK is `local_rank` (read from /proc)."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if any(fragment.encode() in arg for arg in cmdline) and b"omni_core.runtime.launch" in cmdline \
                and f"LOCAL_RANK={local_rank}".encode() in environ and b"--standalone" not in cmdline:
            return int(proc.name)
    return None
