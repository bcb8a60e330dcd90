"""The contract between the data loader and the model: one micro-batch of packed multimodal sequences.

All token-level tensors are flat over the micro-batch (the packed sequences laid end to end); documents
are delimited by `cu_seqlens`, so attention never crosses a document boundary. Placeholder tokens (the
tokenizer's `placeholder_ids`) mark where encoder outputs are scattered, in the order images / audio clips /
videos appear; each item's placeholders are contiguous, `video_tokens` of them for a video.

The token counts (`audio_tokens`, `video_tokens`) are what the data's metadata and the FLOP counts ask of
this module without any tensor, so torch is imported where a batch moves, not with the module.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field, fields
from typing import TYPE_CHECKING

from omni_core.common.tokenizer import BYTE_TOKENIZER, Tokenizer

if TYPE_CHECKING:
    import torch

MODALITY_IDS = {"text": 0, "image": 1, "audio": 2, "video": 3}
PLACEHOLDER_KINDS = ("image", "video", "audio")  # the order encoder outputs are laid out in (OmniModel.embed)


@dataclass(frozen=True)
class BatchLayout:
    """The batch's shape as host integers, read once from the CPU tensors before the batch moves to a device.

    Reading a device tensor on the host waits for the GPU (a sync), and the step, the attention of every layer
    and the encoders' splits all need these numbers: they take them from here, never from the device tensors."""

    doc_offsets: tuple[int, ...]  # cu_seqlens
    image_grids: tuple[tuple[int, int], ...]
    audio_frames: tuple[int, ...]
    video_grids: tuple[tuple[int, int, int], ...]
    loss_tokens: int  # targets that are not -100
    real_tokens: int  # tokens that are not padding
    # Packed positions of each modality's placeholders ("image", "video", "audio"), in order: where the
    # encoders' rows go, counted and located without reading input_ids on the device.
    placeholder_positions: dict[str, tuple[int, ...]]
    # Indices of the documents made of padding alone: attention skips them (their outputs are unused, their
    # labels -100), so no kernel spends work on them. Empty by default for layouts built by hand.
    padding_docs: tuple[int, ...] = ()

    @property
    def doc_lengths(self) -> tuple[int, ...]:
        return tuple(end - start for start, end in zip(self.doc_offsets, self.doc_offsets[1:]))

    @property
    def max_doc_length(self) -> int:
        return max(self.doc_lengths, default=0)

    @classmethod
    def of(cls, batch: PackedBatch, tokenizer: Tokenizer) -> BatchLayout:
        """The layout of `batch`, whose ids are `tokenizer`'s: its pad and placeholder ids are looked for."""

        def rows(t: torch.Tensor) -> tuple:
            return tuple(tuple(int(v) for v in row) for row in t.tolist())

        offsets = tuple(int(v) for v in batch.cu_seqlens.tolist())
        # pad tokens before each offset: a document is padding when all of its tokens are (a real document may
        # hold the pad id where padding is EOS, so real tokens are those outside padding documents)
        pads_before = (batch.input_ids == tokenizer.pad_id).long().cumsum(0).tolist()
        pads_before.insert(0, 0)
        padding_docs = tuple(
            doc
            for doc, (start, end) in enumerate(itertools.pairwise(offsets))
            if end > start and pads_before[end] - pads_before[start] == end - start
        )
        return cls(
            doc_offsets=offsets,
            image_grids=rows(batch.image_grids),
            audio_frames=tuple(int(v) for v in batch.audio_frames.tolist()),
            video_grids=rows(batch.video_grids),
            loss_tokens=int((batch.labels != -100).sum()),
            real_tokens=len(batch.input_ids) - sum(offsets[doc + 1] - offsets[doc] for doc in padding_docs),
            placeholder_positions={
                kind: tuple((batch.input_ids == tokenizer.placeholder_ids[kind]).nonzero().flatten().tolist())
                for kind in PLACEHOLDER_KINDS
            },
            padding_docs=padding_docs,
        )


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T] long
    labels: torch.Tensor  # [T] long, next-token target; -100 where no loss (placeholders, padding, last token)
    position_ids: torch.Tensor  # [T] long, position inside its document
    cu_seqlens: torch.Tensor  # [D+1] int32, document boundaries over the flat T tokens (padding is its own doc)
    loss_modality: torch.Tensor  # [T] long, MODALITY_IDS of the sample each target belongs to
    image_patches: torch.Tensor  # [P, 3*patch*patch] float, all images' patches in row-major order
    image_grids: torch.Tensor  # [N_img, 2] long, (rows, cols) patch grid per image
    audio_mels: torch.Tensor  # [F, n_mels] float, all clips' log-mel frames
    audio_frames: torch.Tensor  # [N_aud] long, frames per clip (a multiple of 2)
    video_patches: torch.Tensor  # [P_v, 3*patch*patch] float, frame after frame (row-major), video after video
    video_grids: torch.Tensor  # [N_vid, 3] long, (frames, rows, cols): sampled frames and each frame's patch grid
    num_samples: int  # real samples (documents that are not padding)
    predicted_flops: tuple[float, float] = (0.0, 0.0)  # (encoder, LLM) training FLOPs the loader's cost model predicts
    balance_s: float = 0.0  # seconds the loader spent placing it (data.balance)
    # Read from the tensors where the batch is built (on the CPU) and carried unchanged by `to` and `replace`:
    # it describes the whole batch, also where a rank keeps a slice of its targets (`loss.local_targets`).
    layout: BatchLayout = field(default=None, repr=False)  # type: ignore[assignment]
    # whose ids input_ids holds, where the layout is read here: the byte tokenizer's, in batches laid out by hand
    tokenizer: InitVar[Tokenizer] = BYTE_TOKENIZER

    def __post_init__(self, tokenizer: Tokenizer) -> None:
        if self.layout is None:
            self.layout = BatchLayout.of(self, tokenizer)

    def to(self, device: torch.device | str) -> PackedBatch:
        """The batch on `device`; from pinned memory (`pin_memory`) a CUDA copy does not block the host."""
        return self.map_tensors(lambda tensor: tensor.to(device, non_blocking=True))

    def pin_memory(self) -> PackedBatch:
        """The batch in page-locked host memory (torch's DataLoader calls this when it pins batches)."""
        return self.map_tensors(lambda tensor: tensor.pin_memory())

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedBatch:
        """The batch with `fn` applied to each of its tensors; the rest (the layout included) carried over."""
        import torch

        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for key, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[key] = fn(value)
        return PackedBatch(**moved)

    @property
    def num_loss_tokens(self) -> int:
        return self.layout.loss_tokens


def audio_tokens(frames, pool: int = 1):
    """Embeddings an audio clip yields (ints or arrays): the encoder subsamples log-mel frames by 2, as Whisper
    does (conv1 stride 1, conv2 stride 2), so that Whisper checkpoints load unchanged; with the encoder's `pool`
    (`AudioArgs.pool`, Qwen2-Audio's 2) every `pool` of those are averaged into one, a last partial group
    dropped, as AvgPool1d does. pool 1: the encoder's own tokens, what its cost is counted in."""
    return frames // 2 // pool


def video_tokens(frames, rows, cols, temporal_merge: int, spatial_merge: int):
    """Embeddings a video yields (ints or arrays): `temporal_merge` consecutive frames averaged into one (the
    last group may be shorter), then each merged frame's patch grid merged spatially as an image's is."""
    return -(-frames // temporal_merge) * -(-rows // spatial_merge) * -(-cols // spatial_merge)
