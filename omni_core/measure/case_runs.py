"""Running the validation's cases on the real runtime: every case of one world size in turn on as many ranks,
its steps timed by a tracker that notes when each step's metrics arrive (wall clock, CPU time, and how long
rank 0 waited for a core), each right after rank 0 profiled the device's kernels."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Mapping
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_core.measure.cases import Case, case_recipe
from omni_core.measure.kernels import kernel_probes, profile_compute
from omni_core.measure.probe_device import CPU_PROBES, ProbeDevice
from omni_core.tracking import NullTracker

if TYPE_CHECKING:
    from omni_core.runtime.dist import DistInfo

WARMUP = 2  # steps left out: the first builds pipeline shapes and grows the allocator


def _run_delay() -> float:
    """Seconds this thread has waited for a core since it started (Linux schedstat; 0 elsewhere)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class _StepClock(NullTracker):
    """A tracker that only notes when each step's metrics arrive (log_every=1: once per step): wall clock,
    this process's CPU time, and how long it waited for a core."""

    def __init__(self) -> None:
        self.stamps: dict[str, list[float]] = {"wall_s": [], "cpu_s": [], "delay_s": []}

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.stamps["wall_s"].append(time.perf_counter())
        self.stamps["cpu_s"].append(time.process_time())
        self.stamps["delay_s"].append(_run_delay())


def measure(case: Case, root: Path, info: DistInfo, at: ProbeDevice = CPU_PROBES) -> dict[str, float]:
    """Mean per-step seconds of the case on this rank (every rank calls it) after WARMUP steps: on the wall
    clock, in this process's CPU time, and waiting for a core."""
    from omni_core.runtime.trainer import train

    clock = _StepClock()
    train(case_recipe(case, root, at), info, tracker=clock, log=lambda _: None, save=False)
    return {
        key: statistics.mean([b - a for a, b in pairwise(stamps)][WARMUP - 1 :]) for key, stamps in clock.stamps.items()
    }


def measure_cases(
    rank: int, world: int, root: str, cases: list[Case], repeat: int, at: ProbeDevice = CPU_PROBES
) -> dict[str, dict[str, Any]]:
    """On each rank: every case of this world size in turn, each from a collected heap and right after rank 0
    profiles the device's kernels (`kernels.profile_compute`: on a CPU in process CPU time, on a GPU on the
    synchronised wall clock; the other ranks wait at a barrier): the host's speed drifts within minutes, so a
    prediction and the run it is compared with are measured seconds apart."""
    import torch

    from omni_core.runtime.dist import DistInfo, barrier

    device = torch.device("cuda", rank) if at.device == "cuda" else torch.device("cpu")
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=device)
    kernel_clock = at.wall_clock() if at.device == "cuda" else time.process_time
    probes = kernel_probes(at) if rank == 0 else None
    out: dict[str, dict[str, Any]] = {}
    for case in cases:
        # the previous case's model, meshes and graphs sit in reference cycles until a full collection, and the
        # threads of its (destroyed) process groups poll until then: left alive, they would slow the next case
        gc.collect()
        kernels = profile_compute(repeat, clock=kernel_clock, probes=probes, at=at) if rank == 0 else {}
        barrier()
        out[case.name] = {"kernels": kernels, **measure(case, Path(root), info, at)}
    return out
