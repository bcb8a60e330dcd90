"""The ranks probe: on `world` forked CPU ranks (one gloo process group on loopback), the collectives, the
runtime's wrappers and sharded parameters, and how the ranks slow each other down: by sharing the node's memory
bandwidth, and by each collective waiting for the slowest rank's jitter (`profile_ranks`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from omni_core.measure.block_probes import tiny_block
from omni_core.measure.collective_probes import collective_times, link_cpu_share
from omni_core.measure.parameter_probes import PROBE_TENSOR_COUNTS, parameter_probes, per_group_and_tensor
from omni_core.measure.probe_device import STREAM
from omni_core.measure.sampling import sample
from omni_core.measure.wrapper_probes import wrapper_costs
from omni_core.runtime.ranks import run_ranks

# passes per repeat of the ratios of the ranks' work together to rank 0's alone: ratios of two noisy timings,
# which need many alternations of the host's fast and slow states to settle
RATIO_REPEATS = 6


def profile_ranks(world: int = 2, repeat: int = 5) -> dict[str, Any]:
    """Collectives, per-parameter and per-wrapper costs on `world` forked ranks (wall clock: they wait for
    each other): rank 0's measurements."""
    return run_ranks(_rank_probe, world, repeat)[0]


def _rank_probe(rank: int, world: int, repeat: int) -> dict[str, Any]:
    group_s, tensor_s = dtensor_costs(repeat)
    return {
        "collectives": collective_times(world, repeat),
        "memory_share": memory_share(repeat),
        "straggle": straggle(repeat),
        "link_cpu_share": link_cpu_share(repeat),
        "wrappers": {"dtensor": tensor_s, "dtensor_group": group_s, **wrapper_costs(repeat)},
    }


def dtensor_costs(repeat: int) -> tuple[float, float]:
    """Seconds per parameter group and per tensor (`parameter_probes`) of sharded (DTensor) parameters: what
    FSDP and TP make of every parameter."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    probes = parameter_probes(lambda n: [distribute_tensor(torch.randn(32, 32), mesh, [Shard(0)]) for _ in range(n)])
    secs = sample(probes, 2 * repeat, sync=dist.barrier)
    return per_group_and_tensor([secs[n] for n in PROBE_TENSOR_COUNTS])


def memory_share(repeat: int) -> float:
    """How much slower a memory-bound kernel (elementwise add over a large buffer) runs, in process CPU time,
    when every rank streams at once than on rank 0 alone: the ranks of a CPU node share its memory bandwidth
    (matmuls and operator dispatch are not slowed so, hence only memory-bound work is scaled)."""
    import torch
    import torch.distributed as dist

    x, y = torch.randn(STREAM), torch.randn(STREAM)
    out = torch.empty_like(x)

    def add_seconds() -> float:  # one add in process CPU time, after a warm-up one
        torch.add(x, y, out=out)
        start = time.process_time()
        torch.add(x, y, out=out)
        return time.process_time() - start

    alone = together = 0.0  # sums over alternating passes: the host's fast and slow states average out
    for _ in range(RATIO_REPEATS * repeat):
        dist.barrier()
        if dist.get_rank() == 0:
            alone += add_seconds()
        dist.barrier()
        together += add_seconds()
    return together / alone if alone else 1.0


def straggle(repeat: int, iterations: int = 10) -> float:
    """How much longer every rank's work takes when the ranks synchronise after each piece of it: a tiny block's
    forward + backward x 5 (~10 ms, a phase between two of the runtime's collectives) then a small all-reduce,
    on all ranks, against rank 0 doing the work alone plus the all-reduce's own time. The ranks jitter
    independently and every collective waits for the slowest (and wakes the waiting ones)."""
    import torch
    import torch.distributed as dist

    tiny, flag = tiny_block(), torch.zeros(16)

    def work() -> None:
        for _ in range(5):
            tiny()

    def reduce() -> None:
        dist.all_reduce(flag)

    def work_then_reduce() -> None:
        work()
        reduce()

    def loop(fn: Callable[[], None]) -> float:
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        return (time.perf_counter() - start) / iterations

    work()
    alone = reduced = both = 0.0  # sums over alternating passes: the host's fast and slow states average out
    for _ in range(RATIO_REPEATS * repeat):
        dist.barrier()
        alone += loop(work) if dist.get_rank() == 0 else 0.0
        dist.barrier()
        reduced += loop(reduce)
        dist.barrier()
        both += loop(work_then_reduce)
    return both / (alone + reduced) if alone else 1.0
