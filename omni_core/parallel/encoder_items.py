"""The step's encoder items as every rank knows them after the metadata exchange (`parallel.encoders`): each
image, video or audio clip (`Item`), the part of one that a rank encodes (`Piece`), and what the assignment
weighs them by (their rows, FLOPs and LSSP split units). Shared by the assignment, the exchanges and the
joint schedule, so that every rank derives the same facts from the same metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omni_core.common.batch import PackedBatch, audio_tokens, video_tokens
from omni_core.common.plan import EncoderSpec
from omni_core.models.args import OmniModelArgs
from omni_core.models.flops import audio_forward_flops, merged_grid, vision_forward_flops
from omni_core.parallel.lssp import lssp_splits

ENCODER_OF = {"image": "vision", "video": "vision", "audio": "audio"}
INPUT_FIELD = {"image": "image_patches", "video": "video_patches", "audio": "audio_mels"}
ACTIVATION_BYTES_PER_TOKEN_DIM = 4 * 16  # fp32, ~16 saved tensors of [tokens, dim] per encoder block


@dataclass(frozen=True)
class Item:
    """One image or audio clip of the step, as every rank knows it after the metadata all-gather."""

    modality: str  # "image" | "video" | "audio"
    shard: int  # the data shard whose batch holds it
    micro: int  # its micro-batch
    shape: tuple[int, ...]  # (rows, cols) in patches, (frames, rows, cols), or (mel frames,)
    start: int  # packed position of its first placeholder in the micro-batch
    input_offset: int  # its first row in the micro-batch's image_patches / video_patches / audio_mels

    @property
    def input_rows(self) -> int:
        return math.prod(self.shape)

    @property
    def tokens(self) -> int:
        """Encoder tokens: patches (of every frame), or subsampled mel frames."""
        return audio_tokens(self.shape[0]) if self.modality == "audio" else self.input_rows


@dataclass(frozen=True)
class Piece:
    """A part of an item's projected rows that one rank produces: all of them, or an LSSP member's chunk."""

    item: Item
    rank: int
    rows: tuple[int, int]  # [first, end) of the item's projected rows
    inputs: tuple[int, int]  # [first, end) of the item's input rows this rank needs
    group: tuple[int, ...] = ()  # the LSSP group (ranks in order); () for a whole item
    splits: tuple[int, ...] = ()  # the group's chunks: encoder tokens (image, audio) or frames (video)


Transfer = tuple[int, Piece, int, int]  # (consumer, piece, first, end): item rows one consumer gets from a piece


def describe_items(batches: list[PackedBatch], shard: int, args: OmniModelArgs) -> list[Item]:
    """Items of one data shard's micro-batches, each with the position of its (contiguous) placeholders."""
    items = []
    for micro, batch in enumerate(batches):
        layout = batch.layout
        for modality, shapes in (
            ("image", layout.image_grids),
            ("video", layout.video_grids),
            ("audio", [(frames,) for frames in layout.audio_frames]),
        ):
            positions = layout.placeholder_positions[modality]
            cursor = offset = 0
            for shape in shapes:
                item = Item(modality, shard, micro, shape, positions[cursor] if positions else -1, offset)
                rows = output_rows(item, args)
                span = positions[cursor : cursor + rows]
                if len(span) != rows or span[-1] - span[0] != rows - 1:
                    raise ValueError(
                        f"micro-batch {micro}: the placeholders of {modality} {shape} are not {rows} contiguous tokens"
                    )
                items.append(item)
                cursor += rows
                offset += item.input_rows
    return items


def output_rows(item: Item, args: OmniModelArgs) -> int:
    """LLM embeddings an item yields (its placeholders)."""
    if item.modality == "image":
        rows, cols = item.shape
        m_rows, m_cols = merged_grid(rows, cols, args.spatial_merge)
        return m_rows * m_cols
    if item.modality == "video":
        frames, rows, cols = item.shape
        return video_tokens(frames, rows, cols, args.temporal_merge, args.spatial_merge)
    return audio_tokens(item.shape[0], args.audio.pool)


def item_cost(item: Item, args: OmniModelArgs) -> float:
    """Forward FLOPs (the models' own count: linear and quadratic in the item's tokens; a video's frames are
    attention documents of their own)."""
    if item.modality == "image":
        return vision_forward_flops(args.vision, item.input_rows)
    if item.modality == "video":
        frames, rows, cols = item.shape
        return frames * vision_forward_flops(args.vision, rows * cols)
    return audio_forward_flops(args.audio, item.shape[0])


def split_units(item: Item, args: OmniModelArgs) -> tuple[int, int]:
    """(units, unit size) an LSSP split cuts an item into, in its split dimension: whole merge-rows of an
    image's patches, groups of `temporal_merge` frames of a video, whole pools of a clip's subsampled tokens
    (one token without a pool; a last partial pool is no unit: it rides with the last, `audio_splits`)."""
    if item.modality == "image":
        unit = args.spatial_merge * item.shape[1]
        return -(-item.tokens // unit), unit
    if item.modality == "video":
        return -(-item.shape[0] // args.temporal_merge), args.temporal_merge
    return item.tokens // args.audio.pool, args.audio.pool


def audio_splits(item: Item, size: int, args: OmniModelArgs) -> tuple[list[int], list[int]]:
    """A clip's encoder tokens over an LSSP group of `size` (members in order) and each member's LLM rows. The
    chunks are whole pools, so that no pool straddles two members and each member pools its own chunk
    (`AudioEncoder.finish`); the tokens of a last partial pool, which the pool drops, join the last chunk
    (attention still sees them, as it does unsplit)."""
    units, pool = split_units(item, args)
    splits = lssp_splits(units * pool, size, pool)
    splits[-1] += item.tokens - units * pool
    return splits, [s // pool for s in splits]


def is_long(item: Item, spec: EncoderSpec, args: OmniModelArgs) -> bool:
    """Over the encoder's threshold by tokens (cost) or by its activations' estimated MiB (memory). An item
    too small to give every member of the group a chunk runs whole."""
    if spec.lssp == 1 or split_units(item, args)[0] < spec.lssp:
        return False
    encoder = getattr(args, ENCODER_OF[item.modality])
    dim, layers = encoder.dim, encoder.n_layers
    by_tokens = spec.long_tokens and item.tokens > spec.long_tokens
    mib = item.tokens * dim * layers * ACTIVATION_BYTES_PER_TOKEN_DIM / 2**20
    return bool(by_tokens or (spec.long_mb and mib > spec.long_mb))
