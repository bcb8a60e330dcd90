"""Packed batches for the model tests, laid out by hand (the unit model tests and the pipeline-parallel ranks
tests share them)."""

from __future__ import annotations

import torch

from omni_core.common.batch import MODALITY_IDS, PackedBatch, audio_tokens, video_tokens
from omni_core.common.tokenizer import AUDIO_ID, IMAGE_ID, VIDEO_ID
from omni_core.models.args import OmniModelArgs

PATCH_SIZE = 8
PATCH_DIM = 3 * PATCH_SIZE * PATCH_SIZE
N_MELS = 32
MERGES = (OmniModelArgs.temporal_merge, OmniModelArgs.spatial_merge)  # the debug flavors' temporal, spatial


def make_batch(docs: list[list[tuple]], seed: int = 0) -> PackedBatch:
    """Pack documents laid out as segments: ("text", n_tokens), ("image", (rows, cols)), ("audio", frames),
    ("video", (frames, rows, cols))."""
    gen = torch.Generator().manual_seed(seed)
    ids, positions, offsets, grids, patches, frames, mels = [], [], [0], [], [], [], []
    video_grids, video_patches = [], []
    for doc in docs:
        doc_ids: list[int] = []
        for kind, size in doc:
            if kind == "text":
                doc_ids += torch.randint(0, 256, (size,), generator=gen).tolist()
            elif kind == "image":
                rows, cols = size
                grids.append([rows, cols])
                patches.append(torch.randn(rows * cols, PATCH_DIM, generator=gen))
                doc_ids += [IMAGE_ID] * (rows * cols)
            elif kind == "video":
                video_grids.append(list(size))
                video_patches.append(torch.randn(size[0] * size[1] * size[2], PATCH_DIM, generator=gen))
                doc_ids += [VIDEO_ID] * video_tokens(*size, *MERGES)
            else:
                frames.append(size)
                mels.append(torch.randn(size, N_MELS, generator=gen))
                doc_ids += [AUDIO_ID] * audio_tokens(size)
        ids += doc_ids
        positions += range(len(doc_ids))
        offsets.append(offsets[-1] + len(doc_ids))
    input_ids = torch.tensor(ids)
    labels = torch.cat([input_ids[1:], torch.tensor([-100])])
    labels[(labels == IMAGE_ID) | (labels == AUDIO_ID) | (labels == VIDEO_ID)] = -100
    return PackedBatch(
        input_ids=input_ids,
        labels=labels,
        position_ids=torch.tensor(positions),
        cu_seqlens=torch.tensor(offsets, dtype=torch.int32),
        loss_modality=torch.full_like(input_ids, MODALITY_IDS["text"]),
        image_patches=torch.cat(patches) if patches else torch.zeros(0, PATCH_DIM),
        image_grids=torch.tensor(grids, dtype=torch.long).reshape(-1, 2),
        audio_mels=torch.cat(mels) if mels else torch.zeros(0, N_MELS),
        audio_frames=torch.tensor(frames, dtype=torch.long),
        video_patches=torch.cat(video_patches) if video_patches else torch.zeros(0, PATCH_DIM),
        video_grids=torch.tensor(video_grids, dtype=torch.long).reshape(-1, 3),
        num_samples=len(docs),
    )


MIXED_DOCS = [
    [("text", 5), ("image", (2, 3)), ("text", 4)],
    [("audio", 16), ("text", 6), ("image", (3, 2))],
    [("text", 7), ("audio", 8), ("text", 3)],
]
VIDEO_DOCS = [[("text", 3), ("video", (3, 2, 3)), ("text", 4)], [("video", (2, 3, 2)), ("text", 5)]]
