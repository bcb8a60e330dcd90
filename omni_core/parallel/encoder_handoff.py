"""The handoff of the encoder step (`parallel.encoders`): encoded rows back to the LLM's ranks that consume
them, every stage-0 rank of the item's data shard getting the rows of its own context-parallel share, by one
variable-split all-to-all whose backward is the mirrored exchange of their gradients (`AllToAll`). The
`joint` schedule sends the same `transfers` point to point instead.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from omni_core.parallel.collectives import AllToAll, all_to_all_uneven
from omni_core.parallel.context import cp_token_index
from omni_core.parallel.encoder_items import Piece, Transfer
from omni_core.parallel.encoder_roles import RankRoles


class Handoff:
    """Who gets which rows (`transfers`), and the exchange itself (`send`). `total_tokens`: a micro-batch's
    packed length, which the consumers' context-parallel shares cut."""

    def __init__(self, roles: RankRoles, total_tokens: int, dim: int, trains: bool, device: torch.device):
        self.roles, self.total_tokens, self.dim, self.trains, self.device = roles, total_tokens, dim, trains, device
        self._shares: dict[int, list[tuple[int, int]]] = {}

    def share(self, rank: int) -> list[tuple[int, int]]:
        """The packed positions [first, end) a consumer's LLM holds (its context-parallel share), worked out
        once per rank: the same every step."""
        if rank not in self._shares:
            plan = self.roles.plan
            if plan.cp == 1:
                self._shares[rank] = [(0, self.total_tokens)]
            else:
                index = cp_token_index(self.total_tokens, plan.cp, self.roles.coords[rank]["cp"], plan.cp_kind)
                chunk = self.total_tokens // (plan.cp if plan.cp_kind == "ulysses" else 2 * plan.cp)
                self._shares[rank] = [(s, s + chunk) for s in index[::chunk].tolist()]
        return self._shares[rank]

    def transfers(self, pieces: list[Piece]) -> list[Transfer]:
        """(consumer, piece, first, end) of item rows, sorted by consumer, micro-batch and packed position:
        the order senders fill and receivers read the handoff buffers in."""
        out = []
        for piece in pieces:
            item = piece.item
            for consumer in self.roles.consumers(item.shard):
                for lo, hi in self.share(consumer):
                    first = max(piece.rows[0], lo - item.start)
                    end = min(piece.rows[1], hi - item.start)
                    if first < end:
                        out.append((consumer, piece, first, end))
        return sorted(out, key=lambda t: (t[0], t[1].item.micro, t[1].item.start + t[2]))

    def bytes_sent(self, transfers: list[Transfer], dtype: torch.dtype) -> float:
        """Bytes of embedding rows this rank sends (and, when the encoders train, their gradients back)."""
        rows = sum(end - first for _, piece, first, end in transfers if piece.rank == self.roles.rank)
        element = torch.finfo(dtype).bits // 8
        return float(rows * self.dim * element * (2 if self.trains else 1))

    def send(
        self,
        transfers: list[Transfer],
        produced: dict[Piece, torch.Tensor],
        n_micro: int,
        dtype: torch.dtype,
        token: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Move the rows to their consumers (every rank's buffers in one dtype: ranks without rows too). The
        sharded chains' `token` rides along (an added zero), so that every rank's backward reaches them.

        Returns the rows this rank received, sorted by micro-batch and packed position (attached to the
        exchange's graph when the encoders train), and how many of them belong to each micro-batch."""
        rank, world = self.roles.rank, self.roles.world
        outgoing = [t for t in transfers if t[1].rank == rank]
        chunks = [produced[piece][first - piece.rows[0] : end - piece.rows[0]] for _, piece, first, end in outgoing]
        send_splits, recv_splits = [0] * world, [0] * world
        for consumer, piece, first, end in transfers:
            if piece.rank == rank:
                send_splits[consumer] += end - first
            if consumer == rank:
                recv_splits[piece.rank] += end - first
        trains, device = self.trains, self.device
        send = torch.cat(chunks).to(dtype) if chunks else torch.zeros(0, self.dim, dtype=dtype, device=device)
        if token is not None and token.requires_grad:
            send = send + 0 * token.to(dtype)
        if trains and not send.requires_grad:  # no rows, or only frozen encoders' rows: the backward still runs
            send = send + torch.zeros((), dtype=dtype, device=device, requires_grad=True)
        exchange = AllToAll.apply if trains else all_to_all_uneven
        received = exchange(send, recv_splits, send_splits, None)
        incoming = sorted((t for t in transfers if t[0] == rank), key=lambda t: t[1].rank)  # stable
        order = sorted(
            range(len(incoming)), key=lambda i: (incoming[i][1].item.micro, incoming[i][1].item.start + incoming[i][2])
        )
        spans = list(received.split([end - first for _, _, first, end in incoming])) if incoming else []
        rows = torch.cat([spans[i] for i in order]) if incoming else received
        per_micro: dict[int, int] = defaultdict(int)
        for i in order:
            per_micro[incoming[i][1].item.micro] += incoming[i][3] - incoming[i][2]
        return rows, [per_micro[m] for m in range(n_micro)]
