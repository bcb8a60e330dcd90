"""The gradients between the backward and the optimizer's step, across every mesh of a plan: a zero gradient
for each trainable parameter the step never reached, the partial sums DTensor leaves made replicated, under a
ZeRO stage the data ranks' gradients reduced (`parallel.zero`), then all ranks' gradients clipped together by
the norm of the whole model's gradient."""

from __future__ import annotations

from collections import defaultdict
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from omni_core.parallel.zero import zero_shards
from omni_core.runtime.replica import ModelReplica

ENCODER_PREFIXES = ("vision.", "audio.", "projectors.")


def fill_missing_grads(params: list[nn.Parameter]) -> None:
    """A zero gradient for each trainable parameter the step never reached: keeps optimizer state uniform."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)


def replicate_partial_grads(params: list[nn.Parameter]) -> None:
    """Sum the gradients DTensor leaves partial (TP-replicated weights, e.g. the norms before sequence-sharded
    inputs) with one flat all-reduce per (mesh, placements), and make them replicated.

    Left partial, every operator that reads such a gradient all-reduces it again: three per tensor in
    AdamW's foreach step and one in the gradient norm, each paying a collective's latency."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    groups: dict[tuple, list[tuple[nn.Parameter, DTensor]]] = defaultdict(list)
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            groups[(grad.device_mesh, grad.placements)].append((param, grad))
    for (mesh, placements), members in groups.items():
        flat = torch.cat([grad.to_local().reshape(-1) for _, grad in members])
        for dim, placement in enumerate(placements):
            if not isinstance(placement, Partial):
                continue
            if type(placement) is not Partial or placement.reduce_op not in ("sum", "avg"):  # e.g. a norm's
                raise ValueError(f"gradient partial as {placement}: only sums and averages are reduced")
            dist.all_reduce(flat, group=mesh.get_group(dim))
            if placement.reduce_op == "avg":
                flat /= mesh.size(dim)
        replicated = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
        offset = 0
        for param, grad in members:
            local = grad.to_local()
            reduced = flat[offset : offset + local.numel()].view_as(local)
            offset += local.numel()
            param.grad = DTensor.from_local(
                reduced, mesh, replicated, run_check=False, shape=grad.shape, stride=grad.stride()
            )


def finish_gradients(replica: ModelReplica) -> None:
    """The step's gradients ready for the norm and the optimizer: every trainable parameter has one, TP's
    partial sums are replicated, and under a ZeRO stage the data ranks' are summed (FSDP summed its own in
    the backward), each slice the optimizer steps holding its rows."""
    params = replica.trainable()
    fill_missing_grads(params)
    replicate_partial_grads(params)
    for part in replica.parts:
        shards = zero_shards(part)
        if shards is not None:
            shards.reduce_gradients()


def clip_grad_norm(replica: ModelReplica, max_norm: float, device: torch.device) -> torch.Tensor:
    """Clip all ranks' gradients together by the norm of the whole model's gradient; returns that norm, a
    float64 scalar on `device`, unread: the scale is applied on the device, as torch's `clip_grad_norm_`
    applies it (min(1, max_norm / (norm + 1e-6)), at every step), so clipping needs no host sync.

    Sharded (DTensor) gradients are reduced by DTensor per (mesh, placement) group, so replicated copies
    count once; experts under EP differ across the EP group and stages across pipeline ranks, so those
    squares are summed over their groups too. `omni` encoders are replicated on every rank (pipeline ranks
    included) with summed gradients: counted once, after the pipeline's sum."""
    groups = _params_by_kind(replica)
    squares = _squared_norms(groups, device)
    total = _total_squared_norm(replica, squares).sqrt()
    if max_norm > 0:
        for params in groups.values():  # per group: one call's gradients share their mesh and placements
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _params_by_kind(replica: ModelReplica) -> dict[tuple, list[nn.Parameter]]:
    """This rank's parameters with gradients keyed by (kind: dense, expert or encoder; mesh; placements) of
    their gradient, the mesh and placements None for plain tensors: each group's norm is one reduction."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, list[nn.Parameter]] = defaultdict(list)
    for part in replica.parts:
        shards = zero_shards(part)  # under ZeRO the slices the optimizer steps: each element counted once
        for name, param in shards.named_shards() if shards is not None else part.named_parameters():
            if param.grad is None:
                continue
            grad = param.grad
            kind = "expert" if ".experts." in name else "dense"
            if replica.encoders is not None and name.startswith(ENCODER_PREFIXES):
                kind = "encoder"
            key = (kind, grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else (kind, None, None)
            groups[key].append(param)
    return groups


def _squared_norms(groups: dict[tuple, list[nn.Parameter]], device: torch.device) -> dict[str, torch.Tensor]:
    """The squared gradient norm of each kind over this rank's groups (a sharded group's over its mesh),
    float64 on `device`."""
    from torch.distributed.tensor import DTensor

    # One tensor per kind: the all-reduces below write in place, and a kind without gradients here keeps its zero.
    squares = {kind: torch.zeros((), dtype=torch.float64, device=device) for kind in ("dense", "expert", "encoder")}
    for (kind, mesh, _), params in groups.items():
        norm = torch.nn.utils.get_total_norm([cast(torch.Tensor, p.grad) for p in params], foreach=True)
        if mesh is not None:
            norm = cast(DTensor, norm).full_tensor()
        squares[kind] = squares[kind] + norm.detach().double() ** 2
    return squares


def _total_squared_norm(replica: ModelReplica, squares: dict[str, torch.Tensor]) -> torch.Tensor:
    """The whole model's squared gradient norm on every rank: the experts' summed over the EP group, the
    LLM's over pipeline stages, and under `disaggregated` the LLM's and the encoders' halves joined."""
    meshes = replica.meshes
    if meshes is not None and replica.plan.ep > 1 and replica.loads_data:
        dist.all_reduce(squares["expert"], group=meshes.ep_group)
    total_sq = squares["dense"] + squares["expert"]
    if meshes is not None and replica.plan.pp > 1 and replica.loads_data:
        dist.all_reduce(total_sq, group=meshes.group("pp"))
    if replica.plan.encoders.ranks:  # disaggregated: the LLM's ranks and the encoders' each know their half
        first_encoder_rank = replica.plan.llm_world_size
        rank, zero = dist.get_rank(), torch.zeros_like(total_sq)
        halves = torch.stack(
            [total_sq if rank == 0 else zero, squares["encoder"] if rank == first_encoder_rank else zero]
        )
        dist.all_reduce(halves)
        total_sq, squares["encoder"] = halves[0], halves[1]
    return total_sq + squares["encoder"]
