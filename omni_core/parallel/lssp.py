"""Long-short sequence parallelism (LSSP, MegaScale-Omni): one long encoder item (an image, an audio clip) split
over the S ranks of an LSSP group, with Ulysses attention inside the encoder.

Each member holds a contiguous chunk of the item's tokens (`lssp_splits`); everything but attention is
per-token and runs on the chunk. Attention swaps "my chunk x all heads" for "all tokens x H/S heads" with one
uneven all-to-all per q/k/v, attends over the whole item, and swaps back. The encoders take the
`SequenceShard` as their `shard` argument (`omni_core.models.attention.EncoderShard` is the protocol).

The groups are runs of consecutive encoder ranks (`lssp_group_ranks`): the assignment places a long item on
one of them and every rank creates their process groups (`new_lssp_groups`) in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from omni_core.models.attention import varlen_attention
from omni_core.parallel.collectives import AllToAll


def lssp_splits(n_tokens: int, size: int, align: int = 1) -> list[int]:
    """Contiguous chunk lengths of `n_tokens` over `size` members, in group rank order, as even as possible.

    Every chunk is a whole number of `align`-token units (a vision caller passes spatial_merge * cols, so a
    chunk is whole merge rows) except the last, which ends with the item's partial unit, if any. Members get
    len // size units and the trailing ones one more: the last member holds the partial unit, so extras at the
    end even the token counts out. Every member gets at least one unit; an item too short for that is refused
    (ValueError) rather than given empty chunks: such an item is short and should not be split.
    """
    if size < 1 or align < 1:
        raise ValueError(f"LSSP needs a group size and an alignment of at least 1, got size={size}, align={align}")
    units = -(-n_tokens // align)
    if units < size:
        raise ValueError(
            f"{n_tokens} tokens make {units} chunks of {align}, too few for an LSSP group of {size}: "
            f"every member needs at least one"
        )
    base, extra = divmod(units, size)
    splits = [(base + (member >= size - extra)) * align for member in range(size)]
    splits[-1] -= units * align - n_tokens
    return splits


def lssp_group_ranks(ranks: Sequence[int], size: int) -> list[tuple[int, ...]]:
    """The LSSP groups of `size` members over the encoder ranks `ranks`: consecutive runs in rank order (ranks
    left over at the end are in none)."""
    return [tuple(ranks[i : i + size]) for i in range(0, len(ranks) - size + 1, size)]


def new_lssp_groups(ranks: Sequence[int], sizes: Iterable[int]) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """A process group for every LSSP group of each size in `sizes` (1: no group). Every rank of the world
    creates every group, members or not, in one order: `new_group` is collective over the world."""
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for size in sorted(set(sizes) - {1}):
        for group in lssp_group_ranks(ranks, size):
            groups[group] = dist.new_group(list(group))
    return groups


@dataclass(frozen=True)
class SequenceShard:
    """This member's chunk of one long item split over `group`: `splits[j]` tokens on group rank j.

    Every member of `group` must run the encoder on the same item in the same order: attention communicates
    in forward and in backward.
    """

    group: dist.ProcessGroup
    splits: list[int]

    def __post_init__(self) -> None:
        size = dist.get_world_size(self.group)
        if len(self.splits) != size or min(self.splits) < 1:
            raise ValueError(f"an LSSP group of {size} needs {size} positive chunk lengths, got {self.splits}")

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def offset(self) -> int:
        return sum(self.splits[: self.rank])

    @property
    def length(self) -> int:
        return self.splits[self.rank]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Ulysses attention: q/k/v [length, H, D] of this chunk -> [length, H, D], non-causal over the whole item.

        Heads split over the members (H % S == 0), so each runs one SDPA over all N tokens for H/S heads.
        Differentiable: the all-to-alls' backward is the reverse exchange.
        """
        size = len(self.splits)
        if q.shape[1] % size:
            raise ValueError(
                f"LSSP splits the encoder's attention heads over its group: {q.shape[1]} heads do "
                f"not divide by the LSSP group size {size}"
            )
        if q.shape[0] != self.length:
            raise ValueError(f"LSSP rank {self.rank} holds {self.length} tokens, got {q.shape[0]}")
        q, k, v = (self._gather_tokens(x) for x in (q, k, v))
        out = varlen_attention(q, k, v, [0, sum(self.splits)], causal=False)
        return self._scatter_tokens(out)

    def _gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[length, H, D] -> [N, H/S, D]: head group j goes to member j; tokens arrive in rank order = item order."""
        size, n = len(self.splits), x.shape[0]
        send = x.unflatten(1, (size, -1)).transpose(0, 1).flatten(0, 1)  # [S * length, H/S, D], head group major
        return AllToAll.apply(send, self.splits, [n] * size, self.group)

    def _scatter_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[N, H/S, D] -> [length, H, D]: member j's tokens go back to it; head groups arrive in rank order."""
        size, n = len(self.splits), self.length
        recv = AllToAll.apply(x, [n] * size, self.splits, self.group)  # [S * length, H/S, D]
        return recv.unflatten(0, (size, n)).transpose(0, 1).flatten(1, 2)
