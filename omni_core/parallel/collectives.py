"""Collectives the parallel layouts share: the uneven, differentiable all-to-all along dim 0 (expert dispatch,
LSSP's Ulysses exchange, the encoder-to-LLM handoff)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_to_all_uneven(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Rows of `x` split by `in_splits` to the group's ranks (None: the world's) in order; receives `out_splits`
    rows from each.
    all_to_all_single with split sizes: the list form of all_to_all fails on gloo with unequal sizes."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Differentiable uneven all-to-all along dim 0: its backward is the reverse exchange (splits swapped)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all_uneven(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return all_to_all_uneven(grad, in_splits, out_splits, ctx.group), None, None, None
