"""Greedy captioning/transcription of held-out documents: the task metric of evaluation.

A held-out image, audio or video document is `BOS, placeholders..., caption bytes..., EOS`. The model sees
everything up to the last placeholder and decodes greedily; the decoded text is compared with the caption
word by word. On the synthetic data each caption word is an attribute of the input (colour, shape,
background; the names of the tones), so word accuracy is attribute accuracy.

Works on `PackedBatch` alone: a batch is split into its documents by `cu_seqlens`, and each document's
images, clips and videos are found by counting its placeholders, so nothing here depends on the data source.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from omni_core.common.batch import MODALITY_IDS, PackedBatch, audio_tokens
from omni_core.common.tokenizer import AUDIO_ID, EOS_ID, IMAGE_ID, NUM_BYTES, PAD_ID, VIDEO_ID, ByteTokenizer
from omni_core.models.omni import OmniModel

MODALITY_NAMES = {index: name for name, index in MODALITY_IDS.items()}


@dataclass
class Document:
    modality: str
    input_ids: torch.Tensor
    image_patches: torch.Tensor
    image_grids: torch.Tensor
    audio_mels: torch.Tensor
    audio_frames: torch.Tensor
    video_patches: torch.Tensor
    video_grids: torch.Tensor

    def with_tokens(self, ids: torch.Tensor) -> PackedBatch:
        """`ids` (a prefix of this document, maybe extended by decoding) as a one-document batch with all of
        the document's encoder inputs."""
        return PackedBatch(
            input_ids=ids,
            labels=torch.full_like(ids, -100),
            position_ids=torch.arange(len(ids)),
            cu_seqlens=torch.tensor([0, len(ids)], dtype=torch.int32),
            loss_modality=torch.full_like(ids, MODALITY_IDS[self.modality]),
            image_patches=self.image_patches,
            image_grids=self.image_grids,
            audio_mels=self.audio_mels,
            audio_frames=self.audio_frames,
            video_patches=self.video_patches,
            video_grids=self.video_grids,
            num_samples=1,
        )


def documents(
    batch: PackedBatch, tokens_per_image: Callable[[int, int], int], tokens_per_video: Callable[[int, int, int], int]
) -> Iterator[Document]:
    """The batch's real documents, each with its own images, clips and videos (padding documents are skipped)."""
    bounds = batch.cu_seqlens.tolist()
    image, patch, clip, frame, video, video_patch = 0, 0, 0, 0, 0, 0
    for start, end in itertools.pairwise(bounds):
        ids = batch.input_ids[start:end]
        n_images, n_audio_tokens = int((ids == IMAGE_ID).sum()), int((ids == AUDIO_ID).sum())
        first_image, first_patch = image, patch
        while n_images > 0:
            rows, cols = batch.image_grids[image].tolist()
            n_images -= tokens_per_image(rows, cols)
            patch, image = patch + rows * cols, image + 1
        first_clip, first_frame = clip, frame
        while n_audio_tokens > 0:
            frames = int(batch.audio_frames[clip])
            n_audio_tokens -= audio_tokens(frames)
            frame, clip = frame + frames, clip + 1
        first_video, first_video_patch, n_video_tokens = video, video_patch, int((ids == VIDEO_ID).sum())
        while n_video_tokens > 0:
            frames, rows, cols = batch.video_grids[video].tolist()
            n_video_tokens -= tokens_per_video(frames, rows, cols)
            video_patch, video = video_patch + frames * rows * cols, video + 1
        if int(ids[0]) == PAD_ID:
            continue
        yield Document(
            MODALITY_NAMES[int(batch.loss_modality[start])],
            ids,
            batch.image_patches[first_patch:patch],
            batch.image_grids[first_image:image],
            batch.audio_mels[first_frame:frame],
            batch.audio_frames[first_clip:clip],
            batch.video_patches[first_video_patch:video_patch],
            batch.video_grids[first_video:video],
        )


@torch.no_grad()
def greedy_caption(model: OmniModel, doc: Document, max_new: int, max_len: int | None = None) -> tuple[str, str] | None:
    """(decoded, reference) for a document whose caption follows its media; None for text-only ones. The
    prompt and what is generated stay within `max_len` tokens (training's sequence length)."""
    media = ((doc.input_ids == IMAGE_ID) | (doc.input_ids == AUDIO_ID) | (doc.input_ids == VIDEO_ID)).nonzero()
    if len(media) == 0:
        return None
    prompt = int(media[-1]) + 1
    tokenizer = ByteTokenizer()
    reference = tokenizer.decode([t for t in doc.input_ids[prompt:].tolist() if t < NUM_BYTES])
    generated: list[int] = []
    ids = doc.input_ids[:prompt]
    for _ in range(max_new if max_len is None else min(max_new, max_len - prompt)):
        token = int(model(doc.with_tokens(ids))[-1].argmax())
        if token == EOS_ID or token >= NUM_BYTES:
            break
        generated.append(token)
        ids = torch.cat([ids, ids.new_tensor([token])])
    return tokenizer.decode(generated), reference


def word_accuracy(decoded: str, reference: str) -> float:
    """Share of reference words reproduced at their position."""
    ref, got = reference.split(), decoded.split()
    return sum(a == b for a, b in zip(ref, got, strict=False)) / max(len(ref), 1)
