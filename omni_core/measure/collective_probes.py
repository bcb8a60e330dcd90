"""The collectives' probes on the ranks of one node: each collective kind and a neighbour exchange timed at
several buffer sizes (their latency and bandwidth are fitted from these), and how much of their wall time a
rank's process spends on a core. Under gloo on forked CPU ranks (`rank_probes`) or under NCCL on GPUs
(`profile_links`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from omni_core.estimator.cost import COLLECTIVES
from omni_core.measure.probe_device import CPU_PROBES, ProbeDevice
from omni_core.measure.sampling import sample
from omni_core.runtime.ranks import run_ranks

if TYPE_CHECKING:
    import torch

COLLECTIVE_BYTES = (12 << 10, 96 << 10, 768 << 10, 3 << 20)  # divisible by 4-byte floats x world sizes 1..4
# NCCL over NVLink moves megabytes in microseconds: buffers up to 256 MB (divisible by 4-byte floats x 1-8 ranks)
GPU_COLLECTIVE_BYTES = (3 << 16, 3 << 20, 3 << 23, 3 << 26)
# passes per repeat of the collectives: their latency is the intercept of a line through millisecond timings,
# which a few passes leave at the mercy of the host's jitter
COLLECTIVE_REPEATS = 8


def collective_times(
    world: int, repeat: int, at: ProbeDevice = CPU_PROBES, sizes: tuple[int, ...] = COLLECTIVE_BYTES
) -> dict[str, dict[int, float]]:
    """Wall seconds of each collective (and a neighbour exchange) per buffer size on the default group, with
    buffers on `at`'s device (rank r's GPU r under NCCL)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    dev = torch.device(at.device, rank) if at.device == "cuda" else torch.device("cpu")
    probes: dict[tuple[str, int], Callable[[], object]] = {}
    for size in sizes:
        probes.update({(kind, size): call for kind, call in _collectives(size // 4, rank, world, dev).items()})
    secs = sample(probes, COLLECTIVE_REPEATS * repeat, clock=at.wall_clock(), sync=dist.barrier)
    times: dict[str, dict[int, float]] = {kind: {} for kind in (*COLLECTIVES, "p2p")}
    for (kind, size), seconds in secs.items():
        times[kind][size] = seconds
    return times


def _collectives(n: int, rank: int, world: int, dev: torch.device) -> dict[str, Callable[[], object]]:
    """Each collective kind over a buffer of `n` floats on `dev`, and an exchange with the neighbouring ranks."""
    import torch
    import torch.distributed as dist

    from omni_core.common.torch_compat import all_gather_single, reduce_scatter_single

    buf, out, scattered = (
        torch.ones(n, device=dev),
        torch.empty(n * world, device=dev),
        torch.empty(n // world, device=dev),
    )
    a2a_out = torch.empty(n, device=dev)
    recv = torch.empty(n, device=dev)

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, buf, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return {
        "all_reduce": lambda: dist.all_reduce(buf),
        "all_gather": lambda: all_gather_single(out, buf),
        "reduce_scatter": lambda: reduce_scatter_single(scattered, buf),
        "all_to_all": lambda: dist.all_to_all_single(a2a_out, buf),
        "p2p": exchange,
    }


def link_cpu_share(repeat: int) -> float:
    """Of the wall seconds the collectives' probe sizes take (each kind, gloo on this host), the share the rank's
    process spends on a core (its own and gloo's threads: copies, polling); the rest is waiting for peers."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    buffers = [torch.ones(size // 4) for size in COLLECTIVE_BYTES]
    calls = [call for buf in buffers for call in _gloo_calls(buf, world)]
    for call in calls:  # warm
        call()
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(COLLECTIVE_REPEATS * repeat):
        for call in calls:
            call()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return min(1.0, cpu / wall)


def _gloo_calls(buf: torch.Tensor, world: int) -> list[Callable[[], object]]:
    """An all-reduce, an all-gather and a reduce-scatter of `buf` (their outputs allocated per call)."""
    import torch
    import torch.distributed as dist

    from omni_core.common.torch_compat import all_gather_single, reduce_scatter_single

    return [
        lambda: dist.all_reduce(buf),
        lambda: all_gather_single(torch.empty(buf.numel() * world), buf),
        lambda: reduce_scatter_single(torch.empty(buf.numel() // world), buf),
    ]


def _link_probe(rank: int, world: int, repeat: int, at: ProbeDevice) -> dict[str, Any]:
    return {"collectives": collective_times(world, repeat, at, GPU_COLLECTIVE_BYTES)}


def profile_links(world: int, repeat: int, at: ProbeDevice) -> dict[str, Any]:
    """The collectives alone on `world` GPU ranks under NCCL (spawned: a forked process cannot use CUDA):
    rank 0's measurements. The runtime's wrappers (FSDP, TP, pipeline) keep their default costs there."""
    return run_ranks(_link_probe, world, repeat, at, backend="nccl")[0]
