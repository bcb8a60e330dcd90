"""Process-group set-up and teardown that behave the same under torchrun and in a plain process.

Under torchrun (WORLD_SIZE set) we join a process group with a finite timeout, so one dead rank fails the
others instead of hanging them. In a plain process (tests, in-process evaluation) there is no group and
every collective below degenerates to a no-op, so the trainer has one code path.

The backend is decided once, here (`process_group_backend`): on GPUs the group is `cpu:gloo,cuda:nccl`, so
that the step's collectives run on NCCL over device tensors and the control plane's CPU tensors (object
collectives, barriers) on gloo. Every group made later (`new_group`, DeviceMesh) inherits that pairing: the
default group is not bound to a device, so DeviceMesh makes its groups with `new_group` rather than NCCL's
`split_group`.

A one-rank world skips the step's reductions (`collects`). `OMNI_ALWAYS_COLLECT=1` turns that shortcut off,
so that a one-rank NCCL group runs every collective of the step (the GPU check and the CPU tests use it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def uses_cuda(backend: str) -> bool:
    """Whether ranks under `backend` (parallel.backend) each take a GPU, cuda:<local rank>: when there are GPUs."""
    return torch.cuda.is_available() and backend in ("auto", "nccl")


ALWAYS_COLLECT_ENV = "OMNI_ALWAYS_COLLECT"


def process_group_backend(backend: str) -> str:
    """The process group's backend for `parallel.backend`: gloo on CPU, gloo for CPU tensors beside NCCL for
    CUDA tensors on GPUs (auto or nccl)."""
    if uses_cuda(backend):
        return "cpu:gloo,cuda:nccl"
    if backend == "nccl":
        raise ValueError("parallel.backend=nccl needs CUDA GPUs, and this machine has none")
    return "gloo"


def collects() -> bool:
    """Whether the step's collectives run: in a group of several ranks, or of one under OMNI_ALWAYS_COLLECT=1."""
    if not dist.is_initialized():
        return False
    return dist.get_world_size() > 1 or os.environ.get(ALWAYS_COLLECT_ENV) == "1"


def init_distributed(backend: str = "auto", timeout_s: float = 300.0) -> DistInfo:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = uses_cuda(backend)
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    elif "LOCAL_WORLD_SIZE" in os.environ:
        pin_to_own_cores(local_rank, int(os.environ["LOCAL_WORLD_SIZE"]))
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            process_group_backend(backend),
            store=_attempt_store(world_size, timeout),
            rank=int(os.environ["RANK"]),
            world_size=world_size,
            timeout=timeout,
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def pin_to_own_cores(local_rank: int, local_world: int) -> None:
    """A CPU rank's threads on its own share of the cores, as a GPU rank has its own device: what a rank leaves
    idle (a pipeline bubble) is then its own time, not a peer's, which matters to the joint encoder schedule's
    idle-priority thread. Left alone when there are more local ranks than cores (they share cores anyway)."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // local_world
    if share >= 1:
        os.sched_setaffinity(0, cores[local_rank * share : (local_rank + 1) * share])


def _attempt_store(world_size: int, timeout: timedelta) -> dist.Store:
    """torchrun's store, its keys under this launch attempt's prefix. torch's own env:// set-up shares the
    agent's store across `--max-restarts` attempts unprefixed (it assumes a new store per attempt), so after a
    restart a rank read its peer's address of the attempt before and gloo's connect was refused."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_store and os.environ["RANK"] == "0",
        timeout=timeout,
        multi_tenant=not agent_store,
    )
    return dist.PrefixStore(f"omni/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks in place (a no-op where nothing `collects`)."""
    return _all_reduce(tensor, dist.ReduceOp.SUM)


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Maximum over ranks in place (a no-op where nothing `collects`)."""
    return _all_reduce(tensor, dist.ReduceOp.MAX)


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    if collects():
        dist.all_reduce(tensor, op=op)
    return tensor


def on_device(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """Host numbers as one float64 tensor on the step's device, for a collective. The copy does not wait for
    the device's queued work: a blocking copy (`torch.tensor(..., device=...)`) would, as a host sync does."""
    return torch.tensor(values, dtype=torch.float64).to(device, non_blocking=True)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown(exit_code: int) -> None:
    """Leave the process group and exit without running interpreter teardown.

    On gloo a finished rank sometimes aborts in static destructors ("terminate called without an active
    exception"), turning a good run into exit 1; skipping teardown with os._exit after flushing fixes it.
    """
    if dist.is_initialized():
        if exit_code == 0:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
