"""What the runtime's wrappers cost the host per forward + backward, measured on the ranks: an FSDP2 unit and
each parameter tensor in it, a TP-parallel Linear, one more micro-batch through a 1F1B pipeline. Each is a
difference between stacks of tiny Linears (wrapped against plain, deep against shallow) sampled together, so
that the stacks' own compute cancels."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, cast

from omni_core.measure.sampling import Probes, sample

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import Schedule1F1B

PROBE_DIM = 48  # width of the ranks probes' Linears: divisible by world sizes 1-4
WRAPPER_REPEATS = 4  # the wrapper probes are differences of millisecond timings: more passes for their means
WRAP_DEPTHS = (2, 8)  # stacks of the wrapper probes: the difference is what one more wrapped module costs


def probe_stack(depth: int, width: int = 1) -> nn.Sequential:
    """`depth` modules of `width` tiny Linears each."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(*[nn.Linear(PROBE_DIM, PROBE_DIM) for _ in range(width)]) for _ in range(depth)]
    )


def wrapper_costs(repeat: int) -> dict[str, float]:
    """Seconds the runtime's wrappers add per forward + backward, with their collectives' latency (their volume
    is priced by the links): an FSDP2 unit and each parameter tensor in it (units of one and of four tiny
    Linears), a TP-parallel Linear, one more micro-batch through a 1F1B pipeline with a stage per rank. Each
    is a difference between stacks (wrapped against plain, deep against shallow) sampled together."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    micro = [max(d, world) for d in WRAP_DEPTHS]
    probes = {**_stack_probes(mesh), **_pipeline_probes(rank, world, micro)}
    secs = sample(probes, WRAPPER_REPEATS * repeat, sync=dist.barrier)
    return _added_seconds(secs, micro)


def _stack_probes(mesh: DeviceMesh) -> Probes:
    """Forward + backward of plain stacks, and of the same under FSDP2 (units of one and of four Linears) and
    under TP, at both WRAP_DEPTHS."""
    import torch

    x = torch.randn(16, PROBE_DIM)
    low, high = WRAP_DEPTHS
    stacks = {
        "plain": ((low, 1), (high, 1), (high, 4)),
        "fsdp": ((low, 1), (high, 1), (high, 4)),
        "tp": ((low, 1), (high, 1)),
    }
    wraps: dict[str, Callable[[nn.Sequential, DeviceMesh], nn.Module]] = {
        "plain": lambda model, _mesh: model,
        "fsdp": _fsdp,
        "tp": _tp,
    }
    return {
        (name, depth, width): _forward_backward(wraps[name](probe_stack(depth, width), mesh), x)
        for name, shapes in stacks.items()
        for depth, width in shapes
    }


def _fsdp(model: nn.Sequential, mesh: DeviceMesh) -> nn.Module:
    """Every module of the stack an FSDP2 unit, under the root's."""
    from torch.distributed.fsdp import fully_shard

    for unit in model:
        fully_shard(unit, mesh=mesh)
    return cast("nn.Module", fully_shard(model, mesh=mesh))  # the module itself, its class extended by FSDPModule


def _tp(model: nn.Sequential, mesh: DeviceMesh) -> nn.Module:
    """The stack's Linears alternately column- and row-parallel."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(
        model, mesh, {f"{i}.0": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(len(model))}
    )


def _forward_backward(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model(x).sum().backward()

    return run


def _pipeline_probes(rank: int, world: int, micro: list[int]) -> Probes:
    """A 1F1B step over every rank, each a stage of one Linear, with each of `micro` micro-batches of 16 tokens."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    probes: Probes = {}
    for n in micro:
        schedule = Schedule1F1B(
            PipelineStage(probe_stack(1), rank, world, torch.device("cpu")), n, loss_fn=lambda out, target: out.sum()
        )
        probes[("pp", n)] = _pipeline_step(schedule, torch.randn(16 * n, PROBE_DIM), rank, world)
    return probes


def _pipeline_step(schedule: Schedule1F1B, batch: torch.Tensor, rank: int, world: int) -> Callable[[], None]:
    """One step of `schedule`: the first stage feeds `batch`, the last takes it as the target."""

    def step() -> None:
        if rank == 0:
            schedule.step(batch)
        elif rank == world - 1:
            schedule.step(target=batch)
        else:
            schedule.step()

    return step


def _added_seconds(secs: dict[Hashable, float], micro: list[int]) -> dict[str, float]:
    """The wrappers' costs from the probes' seconds: per FSDP unit and per tensor in it, per TP-parallel module,
    per pipeline micro-batch (never below nothing)."""
    low, high = WRAP_DEPTHS

    def added(wrap: str, depth: int, width: int) -> float:
        return secs[(wrap, depth, width)] - secs[("plain", depth, width)]

    per_unit = (added("fsdp", high, 1) - added("fsdp", low, 1)) / (high - low)
    per_tensor = max(0.0, (added("fsdp", high, 4) / high - per_unit) / 6)  # 3 more Linears
    return {
        "fsdp_unit": max(0.0, per_unit - 2 * per_tensor),
        "fsdp_tensor": per_tensor,
        "tp": max(0.0, (added("tp", high, 1) - added("tp", low, 1)) / (high - low)),
        "pp": max(0.0, (secs[("pp", micro[1])] - secs[("pp", micro[0])]) / (micro[1] - micro[0])),
    }
