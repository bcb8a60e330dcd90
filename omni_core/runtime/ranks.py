"""The rank harness: run a function on several gloo ranks forked from this process and collect what each
returns. Calibration, validation and the multi-rank tests share it.

Forking costs ~1 s for 2 ranks (torchrun ~5 s, PLATFORM-NOTES.md), so callers batch several pieces of work
into one call. A rank that raises fails the call with its traceback; the process group has a timeout so
that the other ranks do not wait for it forever.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


class RankError(RuntimeError):
    """A forked rank raised or died; the message carries its traceback."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int,
    world: int,
    port: int,
    out_dir: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    backend: str = "gloo",
) -> None:
    import torch
    import torch.distributed as dist

    from omni_core.runtime.dist import init_distributed

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    init_distributed(backend, timeout_s)
    try:
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    if result[0] == "ok":
        dist.barrier()
    dist.destroy_process_group()


# What the runtime imports on first use (AdamW imports dynamo): imported in the parent before forking, so that
# forked ranks do not each pay for them (seconds per rank on 2 shared cores) inside what a benchmark times.
LAZY_IMPORTS = (
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.nn.functional",
    "torch.distributed.pipelining",
    "torch.distributed.tensor.parallel",
    "omni_core.parallel.context",
    "omni_core.parallel.expert",
    "omni_core.parallel.pipeline",
    "omni_core.parallel.encoders",
)


def preimport() -> None:
    """Import LAZY_IMPORTS in this (parent) process."""
    import importlib

    for module in LAZY_IMPORTS:
        importlib.import_module(module)


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120.0, backend: str = "gloo"
) -> list[Any]:
    """`fn(rank, world, *args)` on `world` ranks on loopback; the ranks' results in rank order. `backend` is
    `parallel.backend`'s (`dist.process_group_backend` decides the group): ranks that take a GPU each (rank r on
    GPU r: "auto" or "nccl" where there are GPUs) are spawned, since a forked process cannot initialise CUDA;
    CPU ranks are forked.

    `fn` must be a module-level function and its arguments and results picklable."""
    import torch.multiprocessing as mp

    from omni_core.runtime.dist import uses_cuda

    # A process group left as garbage (an in-process run's, or a plan's groups after `ParallelMeshes.release`)
    # is freed here, while its threads exist: a forked rank that collected it would join threads it never had.
    gc.collect()
    with tempfile.TemporaryDirectory() as out_dir:
        with contextlib.suppress(mp.ProcessRaisedException):  # the rank's own traceback, written below, says more
            mp.start_processes(
                _rank_main,
                args=(world, free_port(), out_dir, timeout_s, fn, args, backend),
                nprocs=world,
                start_method="spawn" if uses_cuda(backend) else "fork",
            )
        results, failures = [], []
        for rank in range(world):
            path = Path(out_dir, f"rank{rank}.pkl")
            if not path.is_file():
                failures.append(f"rank {rank} of {world} died without a result")
                continue
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                failures.append(f"rank {rank} of {world} failed:\n{value}")
            results.append(value)
        if failures:  # every rank's: the first to fail is often not rank 0 (its peers then lose their connection)
            raise RankError("\n".join(failures))
        return results
