"""Run a function on several gloo ranks forked from the test process, and collect what each rank returns.

Forking costs ~1 s for 2 ranks (torchrun ~5 s, PLATFORM-NOTES.md), so multi-rank tests batch several checks
into one `run_ranks` call. A rank that raises fails the call with its traceback; the process group has a
short timeout so that the other ranks do not hang waiting for it.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        result = ("error", traceback.format_exc())
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    if result[0] == "ok":
        dist.barrier()
    dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """`fn(rank, world, *args)` on `world` forked gloo ranks; returns the ranks' results in rank order.

    `fn` must be a module-level function and its results picklable."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_rank_main, args=(world, free_port(), out_dir, fn, args), nprocs=world,
                               start_method="fork")
        except mp.ProcessRaisedException:
            pass  # the rank's own traceback, written below, says more
        results = []
        for rank in range(world):
            path = Path(out_dir, f"rank{rank}.pkl")
            if not path.is_file():
                raise RuntimeError(f"rank {rank} of {world} died without a result")
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                raise AssertionError(f"rank {rank} of {world} failed:\n{value}")
            results.append(value)
        return results
