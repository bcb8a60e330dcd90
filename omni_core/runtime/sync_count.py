"""Counting host reads of tensors: on a GPU each one waits for the device (a host sync), so the step's path
should make about one per step. Tests count them on CPU; the GPU check counts them on the device.

`count_host_syncs()` patches the Tensor methods that read a value onto the host with counting wrappers for
the duration of a `with` block. Syncs made inside C++ operators (`nonzero`, boolean-mask indexing, a
CUDA `bincount`) never pass through these methods: on CUDA, `cuda_debug=True` also counts the warnings of
`torch.cuda.set_sync_debug_mode`, which sees those.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType

import torch

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass
class SyncCounter:
    """What a `count_host_syncs` block saw: calls per method, per caller site (`file:line`), and, with
    `cuda_debug`, the synchronizing CUDA operations torch reported."""

    by_method: Counter[str] = field(default_factory=Counter)
    by_site: Counter[str] = field(default_factory=Counter)
    cuda_syncs: int = 0
    pauses: int = field(default=0, repr=False)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Reads inside are not counted: work that reads only host tensors on a GPU too (object collectives
        over a `cpu:gloo` group, say), which a CPU test cannot tell apart by device."""
        self.pauses += 1
        try:
            yield
        finally:
            self.pauses -= 1

    @property
    def total(self) -> int:
        return sum(self.by_method.values())

    def summary(self) -> str:
        sites = ", ".join(f"{site} x{n}" for site, n in self.by_site.most_common())
        return f"{self.total} host reads ({dict(self.by_method)}); cuda syncs {self.cuda_syncs}; at: {sites}"


def _caller_site() -> str:
    """The first frame outside this module and torch itself: the line in omni (or a test) that asked."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__ and not name.startswith(_TORCH_DIR):
            return f"{os.path.relpath(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<torch>"


def _counting(method_name: str, original, counter: SyncCounter, counts: Callable[[torch.Tensor], bool], state: dict):
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        # A read inside a counted read (`tolist` calling `__index__`, say) is the same sync, counted once.
        if not state["inside"] and not counter.pauses and counts(self):
            counter.by_method[method_name] += 1
            counter.by_site[_caller_site()] += 1
        state["inside"] += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            state["inside"] -= 1

    return wrapper


@contextmanager
def count_host_syncs(
    device_type: str | None = None,
    cuda_debug: bool = False,
    ignore: Callable[[torch.Tensor], bool] | None = None,
) -> Iterator[SyncCounter]:
    """Count host reads of tensors inside the block. `device_type` counts only tensors on that device type
    ("cuda" on a GPU, where reads of CPU tensors cost no sync); None counts every tensor, as the CPU tests
    must (there every tensor is on the CPU). `ignore`: tensors that stay on the host on a GPU too, which a CPU
    test cannot tell apart by device (an optimizer's step counters, say). Not thread-safe: the patch is
    process-wide."""

    def counts(tensor: torch.Tensor) -> bool:
        on_device = device_type is None or tensor.device.type == device_type
        return on_device and not (ignore is not None and ignore(tensor))

    counter = SyncCounter()
    state = {"inside": 0}
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    # Most are inherited from the C base class: restoring deletes the patch rather than copying them onto Tensor.
    own = {name for name in HOST_READS if name in vars(torch.Tensor)}
    for name, original in originals.items():
        setattr(torch.Tensor, name, _counting(name, original, counter, counts, state))
    try:
        if cuda_debug and torch.cuda.is_available():
            with _counting_cuda_syncs(counter):
                yield counter
        else:
            yield counter
    finally:
        for name, original in originals.items():
            if name in own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)


@contextmanager
def _counting_cuda_syncs(counter: SyncCounter) -> Iterator[None]:
    """torch warns at each synchronizing CUDA operation in its "warn" debug mode: count those warnings."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            counter.cuda_syncs = sum("synchroniz" in str(w.message) for w in caught)
