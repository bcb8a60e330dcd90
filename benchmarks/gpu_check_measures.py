"""What benchmarks/gpu_check.py counts and times around training steps: the steps' device time (CUDA events,
never the host's clock alone on asynchronous work), host syncs (`runtime.sync_count`) and recompiles."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from omni_core.runtime.sync_count import SyncCounter


def skipped(reason: str) -> dict[str, str]:
    """A part that cannot run here: named in the report, and among the summary's skips."""
    return {"status": "skipped", "reason": reason}


class StepTimer:
    """Seconds of each `with timer:` block. On a GPU the block is bracketed by CUDA events, read once at the end
    (one synchronize for all steps, so the timing adds no sync to the steps); on a CPU, whose work is
    synchronous, by the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.walls: list[float] = []
        self._began = 0.0

    def __enter__(self) -> StepTimer:
        if self.cuda:
            self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.events[-1][0].record()
        else:
            self._began = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self.events[-1][1].record()
        else:
            self.walls.append(time.perf_counter() - self._began)

    def seconds(self) -> list[float]:
        if not self.cuda:
            return list(self.walls)
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1000 for start, end in self.events]


def step_timer(device: torch.device) -> StepTimer:
    return StepTimer(device)


@dataclass
class Syncs:
    """Host syncs seen over some steps: reads of device tensors through Tensor's methods (with the line of omni
    that asked) and, on CUDA, the synchronizing operations torch's sync debug mode reports. The debug mode sees
    every sync, those of the reads and those inside C++ operators (`nonzero`, boolean-mask indexing), so the
    count is the larger of the two, never their sum (a read would count twice)."""

    counter: SyncCounter

    def per_step(self, steps: int) -> float | None:
        return max(self.counter.total, self.counter.cuda_syncs) / steps if steps else None

    def detail(self, steps: int) -> dict[str, object]:
        return {
            "steps": steps,
            "host_reads": self.counter.total,
            "cuda_sync_warnings": self.counter.cuda_syncs,
            "sites": dict(self.counter.by_site.most_common(10)),
        }


@contextmanager
def host_sync_counter(device: torch.device, optimizers) -> Iterator[Syncs]:
    """`runtime.sync_count.count_host_syncs` over the block: on a GPU only reads of CUDA tensors (a CPU
    tensor's read waits for nothing) and the CUDA debug mode's syncs; on a CPU every read, as the tests count,
    but AdamW's step counters, which stay on the host on a GPU too (outside fused AdamW)."""
    from omni_core.runtime.sync_count import count_host_syncs

    cuda = device.type == "cuda"
    steps = {id(s["step"]) for opt in optimizers.optimizers for s in opt.state.values() if "step" in s}
    with count_host_syncs("cuda" if cuda else None, cuda_debug=cuda, ignore=lambda t: id(t) in steps) as counter:
        yield Syncs(counter)


@dataclass
class Recompiles:
    count: int | None = None  # None: this torch's dynamo keeps no counter to read


@contextmanager
def count_recompiles() -> Iterator[Recompiles]:
    """Graphs torch.compile compiled during the block (none after warm-up is the target), by the runtime's own
    counter (`parallel.parallelize.compiled_graphs`)."""
    from omni_core.parallel.parallelize import compiled_graphs

    result = Recompiles()
    before = compiled_graphs()
    yield result
    after = compiled_graphs()
    if before is not None and after is not None:
        result.count = after - before
