"""Expert parallelism against the single-process MoE: each EP rank holds its own tokens (EP is folded into data
parallelism), so its output must be the plain MoE's on those tokens, an expert's gradient on its owner the sum
of the plain gradients over the group's tokens, and a replicated (router, shared) gradient the rank's own."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from omni_core.models.args import MoEArgs
from omni_core.models.feed_forward import MoE
from omni_core.parallel.expert import (
    apply_expert_parallel,
    apply_expert_parallel_to_model,
    local_experts,
)
from omni_core.runtime.ranks import run_ranks

DIM, HIDDEN, EXPERTS = 16, 24, 4
# (shared expert, layers, tokens per EP-group rank, experts starved on group rank 0, on group rank 1).
# Starving rank 0 of expert 3 leaves an owner expert that receives nothing from one source; starving everyone
# of expert 3 leaves an expert that runs on zero tokens; one rank has a single token, another none at all.
CASES = [
    (False, 1, (13, 7), (3,), ()),
    (True, 1, (1, 20), (3,), (3,)),
    (True, 2, (0, 9), (), (0,)),
]


def make_model(shared: bool, layers: int) -> nn.Sequential:
    """The same weights on every rank; expert e is favoured by feature e, so tokens can steer the routing."""
    torch.manual_seed(0)
    model = nn.Sequential(*(MoE(DIM, HIDDEN, MoEArgs(num_experts=EXPERTS, top_k=2, shared_expert=shared))
                            for _ in range(layers)))
    with torch.no_grad():
        for moe in model:
            moe.router.weight.add_(3 * torch.eye(EXPERTS, DIM))
    return model


def make_tokens(case: int, group_rank: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and an upstream gradient, different on every data-parallel rank."""
    _, _, sizes, *starved = CASES[case]
    gen = torch.Generator().manual_seed(100 * case + dp_rank)
    x = torch.randn(sizes[group_rank], DIM, generator=gen)
    x[:, list(starved[group_rank])] = -5.0
    return x, torch.randn(sizes[group_rank], DIM, generator=gen)


def run(model: nn.Sequential, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient of loss = <out, g> + the aux losses (absent on an empty batch: they are NaN)."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    loss = (out * g).sum()
    if len(x):
        loss = loss + sum(moe.aux_loss for moe in model)
    loss.backward()
    return out.detach(), x.grad


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def check_case(case: int, group: dist.ProcessGroup, members: list[int]) -> dict[str, float]:
    """Max abs error of this rank's EP output, input / router / shared / expert gradients and aux losses."""
    shared, layers, *_ = CASES[case]
    me = members.index(dist.get_rank())
    full = make_model(shared, layers)
    model = copy.deepcopy(full)
    apply_expert_parallel_to_model(model, group)
    out, x_grad = run(model, *make_tokens(case, me, dist.get_rank()))
    expert_grads: dict[str, torch.Tensor] = {}
    for member, dp_rank in enumerate(members):  # each rank backprops its own loss: expert grads add up
        full.zero_grad()
        ref_out, ref_x_grad = run(full, *make_tokens(case, member, dp_rank))
        for name, p in full.named_parameters():
            if ".experts." in name:
                expert_grads[name] = expert_grads.get(name, 0) + p.grad
        if member == me:
            errors = {"out": max_error(out, ref_out), "x_grad": max_error(x_grad, ref_x_grad),
                      "aux": max((a.aux_loss - b.aux_loss).abs().nan_to_num().item() for a, b in zip(model, full))}
            replicated = {n: p.grad.clone() for n, p in full.named_parameters() if ".experts." not in n}
    kept = {name.split(".")[2] for name, _ in model.named_parameters() if ".experts." in name}
    assert kept == {str(e) for e in local_experts(EXPERTS, len(members), me)}, kept
    for name, p in model.named_parameters():
        ref = expert_grads[name] if ".experts." in name else replicated[name]
        assert p.grad is not None, name
        key = "expert_grad" if ".experts." in name else "replicated_grad"
        errors[key] = max(errors.get(key, 0.0), max_error(p.grad, ref))
    return errors


def ep_ranks(rank: int, world: int, ep: int) -> list[dict[str, float]]:
    """Every case on EP groups of `ep` consecutive ranks (world/ep groups, each checked on its own tokens)."""
    blocks = [list(range(start, start + ep)) for start in range(0, world, ep)]
    groups = [dist.new_group(block) for block in blocks]  # every rank creates every group, in the same order
    members = blocks[rank // ep]
    group = groups[rank // ep]
    errors = [check_case(case, group, members) for case in range(len(CASES))]
    with pytest.raises(ValueError, match="ep=2 does not divide num_experts=3"):
        apply_expert_parallel(MoE(DIM, HIDDEN, MoEArgs(num_experts=3, top_k=1)), group)
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_the_single_process_moe(world: int) -> None:
    for rank, errors in enumerate(run_ranks(ep_ranks, world, 2)):
        for case, case_errors in enumerate(errors):
            assert max(case_errors.values()) < 1e-5, (rank, case, case_errors)
