"""Models and micro-batches the pipeline tests share: the split's unit tests and the runner's ranks tests."""

from __future__ import annotations

from omni_core.models.omni import OmniModel, build_model
from tests.helpers.models import N_MELS, PATCH_SIZE, make_batch

# Four micro-batches of 48 tokens: images and audio, none at all (the encoders' dummy path), one kind only.
MICRO_DOCS = [
    [[("text", 5), ("image", (2, 3)), ("text", 4)], [("audio", 16), ("text", 6), ("image", (3, 2))], [("text", 13)]],
    [[("text", 20)], [("text", 28)]],
    [[("text", 7), ("audio", 8), ("text", 3)], [("image", (4, 4)), ("text", 18)]],
    [[("audio", 20), ("text", 10)], [("text", 28)]],
]


def make_model(flavor: str) -> OmniModel:
    return build_model(flavor, patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)


def micro_batches():
    return [make_batch(docs, seed=i) for i, docs in enumerate(MICRO_DOCS)]
