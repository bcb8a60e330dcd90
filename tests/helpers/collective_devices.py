"""Which collectives of a block of code were handed host tensors, checked on CPU.

On a GPU the step's collectives run on NCCL, which serves CUDA tensors only. On CPU every tensor is a CPU
tensor, so the device cannot tell a compute tensor from a host one: `HostTensors` (a TorchFunctionMode)
follows each tensor made inside the block to where it came from, as a GPU would place it. A factory
without a device (`torch.tensor([...])`, `torch.zeros(n)`), `.cpu()` or `device="cpu"` makes a host tensor;
an explicit device (the compute device) a device tensor; any other operation makes a host tensor only when
all its tensor inputs are host tensors. Tensors made before the block (parameters, the batches, which the
trainer moves to the device) are device tensors. `CollectiveChecker` (a TorchDispatchMode) sees every c10d
and functional collective however it is reached (omni's calls, FSDP, DTensor, pipelining) and records each
one handed a host tensor, with the omni line that called it. Object collectives (`all_gather_object` and
kin) are exempt: they pickle host objects, and torch runs them on the group's CPU backend (gloo, in the
`cpu:gloo,cuda:nccl` group `runtime.dist` makes on GPUs); they are counted apart.

Evaluated first and set aside: torch's fake process group with FakeTensorMode on a fake "cuda" device runs
without CUDA, but a fake step cannot read any value (each `.tolist()` of the step raises), so no real step
runs under it.

The modes are thread-local: work on another thread (the `joint` encoder schedule's, CPU only) is not seen.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_HOST = "_made_on_host"
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
_TORCH_DIR = os.path.dirname(torch.__file__)


def is_host_tensor(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _HOST, False)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _target_device(name: str, args: tuple, kwargs: dict) -> object | None:
    """The device a call names for its result: the `device` keyword, or `.to`'s positional device."""
    if "device" in kwargs:
        return kwargs["device"]
    if name == "to":
        return next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
    return None


def _on_host(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a GPU would place the call's result on the host."""
    if name == "cpu":
        return True
    device = _target_device(name, args, kwargs)
    if device is not None:
        return device == "cpu"  # the literal; the compute device arrives as a torch.device
    inputs = _tensors((args, kwargs))
    return all(is_host_tensor(t) for t in inputs)  # no inputs: a factory on the default device, the host


_IN_PLACE_OPERATORS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")}
_IN_PLACE_OPERATORS |= {f"__i{op}__" for op in ("and", "or", "xor", "lshift", "rshift")}


def _in_place(name: str, kwargs: dict) -> bool:
    """Whether the call writes a tensor it was given (or reads or sets an attribute): nothing new is made."""
    if name in _IN_PLACE_OPERATORS or name in ("__setitem__", "__get__", "__set__") or "out" in kwargs:
        return True
    return name.endswith("_") and not name.startswith("__")


class HostTensors(TorchFunctionMode):
    """Marks the tensors made inside it that a GPU would hold on the host (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if _in_place(name, kwargs):
            return out  # the tensor written keeps its own place
        host = _on_host(name, args, kwargs)
        inputs = {id(t) for t in _tensors((args, kwargs))}

        def mark(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) in inputs and is_host_tensor(tensor) != host:
                tensor = tensor.view_as(tensor)  # `.cpu()` or `.to` of a tensor already there returns it: an alias
            setattr(tensor, _HOST, host)
            return tensor

        return pytree.tree_map_only(torch.Tensor, mark, out)


@dataclass
class CollectiveRecord:
    """The collectives seen, those handed host tensors (op, shapes, the calling omni line), and the object
    collectives called (exempt)."""

    seen: list[str] = field(default_factory=list)
    on_host: list[str] = field(default_factory=list)
    object_collectives: list[str] = field(default_factory=list)


def _callers(depth: int = 2) -> str:
    """The innermost frames outside torch and this module: the omni (or test) lines that reached the collective."""
    lines = []
    frame = sys._getframe(2)
    while frame is not None and len(lines) < depth:
        path = frame.f_code.co_filename
        if path != __file__ and not path.startswith(_TORCH_DIR):
            lines.append(f"{os.path.relpath(path)}:{frame.f_lineno} ({frame.f_code.co_name})")
        frame = frame.f_back
    return " < ".join(lines) or "<torch>"


class CollectiveChecker(TorchDispatchMode):
    def __init__(self, record: CollectiveRecord):
        super().__init__()
        self.record = record
        self.exempt = 0  # inside an object collective

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVE_NAMESPACES and not self.exempt:
            name = str(func)
            self.record.seen.append(name)
            host = [tuple(t.shape) for t in _tensors((args, kwargs)) if is_host_tensor(t)]
            if host:
                self.record.on_host.append(f"{name} given host tensors {host} at {_callers()}")
        return func(*args, **kwargs)


_OBJECT_COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)


def _exempted(name: str, original, checker: CollectiveChecker):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        checker.record.object_collectives.append(name)
        checker.exempt += 1
        try:
            return original(*args, **kwargs)
        finally:
            checker.exempt -= 1

    return wrapper


@contextmanager
def check_collective_devices() -> Iterator[CollectiveRecord]:
    """Inside the block, mark host tensors and record the collectives handed any (see the module docstring)."""
    record = CollectiveRecord()
    checker = CollectiveChecker(record)
    originals = {name: getattr(dist, name) for name in _OBJECT_COLLECTIVES}
    for name, original in originals.items():
        setattr(dist, name, _exempted(name, original, checker))
    try:
        with HostTensors(), checker:
            yield record
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
