"""The inputs' all-to-all of the encoder step (`parallel.encoders`, phase 1): each piece's input rows (patches,
mel frames) reach the rank that encodes it from the owner of its data shard, one all-to-all per modality;
a rank that loads the item's batch slices them locally. Every rank joins every exchange, empty or not.
"""

from __future__ import annotations

import torch

from omni_core.common.batch import PackedBatch
from omni_core.models.args import OmniModelArgs
from omni_core.parallel.collectives import all_to_all_uneven
from omni_core.parallel.encoder_items import INPUT_FIELD, Piece
from omni_core.parallel.encoder_roles import RankRoles


def ship_inputs(
    roles: RankRoles, pieces: list[Piece], batches: list[PackedBatch], args: OmniModelArgs, device: torch.device
) -> dict[Piece, torch.Tensor]:
    """Each of this rank's pieces' input rows: sliced locally where this rank holds the item's batch, else
    received from the shard's owner (one all-to-all per modality, in the canonical piece order)."""
    rank, world = roles.rank, roles.world
    needs = [p for p in pieces if not roles.holds(p.rank, p.item.shard)]
    out: dict[Piece, torch.Tensor] = {}
    widths = {"image": args.vision.patch_dim, "video": args.vision.patch_dim, "audio": args.audio.n_mels}
    for modality in INPUT_FIELD:
        empty = torch.zeros(0, widths[modality], device=device)
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]  # by destination rank
        recv_splits = [0] * world
        mine = []
        for piece in (p for p in needs if p.item.modality == modality):
            source = roles.owner_of_shard[piece.item.shard]
            if source == rank:
                send[piece.rank].append(input_rows(piece, batches))
            if piece.rank == rank:
                recv_splits[source] += piece.inputs[1] - piece.inputs[0]
                mine.append((source, piece))
        send_splits = [sum(t.shape[0] for t in rows) for rows in send]
        flat = torch.cat([t for rows in send for t in rows]) if any(send_splits) else empty
        received = all_to_all_uneven(flat, recv_splits, send_splits, None)
        cursor = [sum(recv_splits[:r]) for r in range(world)]  # each source's rows, in canonical order
        for source, piece in mine:
            rows = piece.inputs[1] - piece.inputs[0]
            out[piece] = received[cursor[source] : cursor[source] + rows]
            cursor[source] += rows
    for piece in pieces:
        if piece.rank == rank and piece not in out:
            out[piece] = input_rows(piece, batches)
    return out


def input_rows(piece: Piece, batches: list[PackedBatch]) -> torch.Tensor:
    """A piece's input rows, sliced from the micro-batch that holds its item."""
    source = getattr(batches[piece.item.micro], INPUT_FIELD[piece.item.modality])
    first = piece.item.input_offset
    return source[first + piece.inputs[0] : first + piece.inputs[1]]
