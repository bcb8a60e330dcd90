"""Expert parallelism (EP) for `MoE`, folded into data parallelism.

The ranks of an EP group are data-parallel ranks: each holds its own tokens, routes them with its replica of
the router, and sends every (token, slot) assignment to the rank that owns the chosen expert; the owners run
their experts and send the results back. Rank r of a group of size ep owns experts [r*E/ep, (r+1)*E/ep) and
deletes the others; the kept parameters keep their global names, so checkpoints reshard between plans.

Gradients: the backward of the dispatch/combine all-to-alls brings every group rank's contribution to the
owner, so an owner's expert gradient is already the sum over the group's tokens. The router and shared expert
stay replicated and get the gradient of the rank's own tokens. A caller summing gradients over data-parallel
ranks must therefore sum expert gradients only over the ranks with the same EP index (the same experts).

Every rank of a group must run the same sequence of MoE forwards and backwards, and agree on whether the
input requires grad: each forward and backward is a collective.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from omni_core.models.feed_forward import MoE, expert_counts, load_balancing_loss
from omni_core.parallel.collectives import AllToAll, all_to_all_uneven


class ExpertParallelMoE(MoE):
    """`MoE` whose routed experts are spread over `ep_group`; installed by `apply_expert_parallel`."""

    ep_group: dist.ProcessGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, experts, weights = self.route(x)
        self.aux_loss = load_balancing_loss(probs, experts, self.args.num_experts, self.sequence_group)
        out = self.shared(x)
        ep, held = dist.get_world_size(self.ep_group), len(self.experts)
        # (token, slot) assignments sorted by expert, hence grouped by owner rank in rank order.
        order = experts.flatten().argsort(stable=True)
        token = order // self.args.top_k
        counts = expert_counts(experts, self.args.num_experts)
        # recv[s, j]: how many assignments source rank s sends to my j-th expert.
        recv = all_to_all_uneven(counts, [held] * ep, [held] * ep, self.ep_group).view(ep, held)
        # The token all-to-alls take their split sizes on the host: one read per MoE layer, only under ep > 1
        # (without EP, `MoE` routes with no host read at all).
        splits = torch.cat([counts.view(ep, held).sum(dim=1), recv.sum(dim=1)]).tolist()
        send_splits, recv_splits = splits[:ep], splits[ep:]
        received = AllToAll.apply(x[token], recv_splits, send_splits, self.ep_group)
        # Received rows come by source rank, each source's rows by expert: group them by my experts.
        local = torch.arange(held, device=x.device).repeat(ep)
        by_expert = local.repeat_interleave(recv.flatten(), output_size=sum(recv_splits)).argsort(stable=True)
        y = self.experts(received[by_expert], recv.sum(dim=0))
        combined = AllToAll.apply(y[by_expert.argsort()], send_splits, recv_splits, self.ep_group)
        return out.index_add(0, token, (combined * weights.flatten()[order, None].to(combined.dtype)).to(out.dtype))


def local_experts(num_experts: int, ep: int, rank: int) -> range:
    """The experts that rank `rank` of an EP group of size `ep` owns: a contiguous block of E/ep."""
    if num_experts % ep:
        raise ValueError(f"expert parallelism: ep={ep} does not divide num_experts={num_experts}")
    per_rank = num_experts // ep
    return range(rank * per_rank, (rank + 1) * per_rank)


def apply_expert_parallel(moe: MoE, group: dist.ProcessGroup) -> None:
    """Keep only this rank's experts (`local_experts`) and exchange tokens with the other owners.

    Apply it to a fully built and initialised model: deleting experts before `init_weights` would shift the
    seeded initialisation of every later module."""
    keep = local_experts(moe.args.num_experts, dist.get_world_size(group), dist.get_rank(group))
    for e in range(moe.args.num_experts):
        if e not in keep:
            del moe.experts[str(e)]
    moe.__class__ = ExpertParallelMoE  # as FSDP's fully_shard does: same state, EP forward
    cast(ExpertParallelMoE, moe).ep_group = group  # the same object, of the EP class from here on


def apply_expert_parallel_to_model(model: nn.Module, group: dist.ProcessGroup) -> None:
    """`apply_expert_parallel` on every `MoE` inside `model` (an LLM or OmniModel)."""
    for module in list(model.modules()):
        if isinstance(module, MoE):
            apply_expert_parallel(module, group)
