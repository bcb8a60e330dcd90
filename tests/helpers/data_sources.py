"""The data-source tests' shared set-up: one generated dataset (its recipe's overrides, SOURCES) as a JSONL manifest and
as WebDataset shards, and how to read a consumer's records back (the unit tests and the S3 server test use them)."""

from __future__ import annotations

from pathlib import Path

import torch

from omni_core.data.dataset import ManifestDataset, open_dataset
from omni_core.data.source_base import Record, View
from tests.helpers.recipes import build_recipe

MIX = {"text": 0.3, "image": 0.3, "audio": 0.2, "video": 0.2}


# the generated dataset, as overrides of tests.helpers.recipes' base: 40 samples of every modality, in shards of 7
SOURCES = {"experiment.name": "s", "experiment.seed": 5, "data.seq_len": 512, "data.synthetic.num_samples": 40,
           "data.synthetic.mix": MIX, "data.synthetic.format": "wds", "data.synthetic.shard_size": 7}


def records(dataset: ManifestDataset, split: str = "all", consumer: int = 0, consumers: int = 1, epoch_seed: int = 0,
            skipped: list[str] | None = None) -> list[Record]:
    view = View(consumer, consumers, split, epoch_seed, one_pass=True, shuffle=split == "train")
    stream = dataset.source.stream(view, None, (skipped if skipped is not None else []).append)
    return list(iter(lambda: stream.next(0), None))


def same_docs(a, b) -> bool:
    inputs_a, inputs_b = (d.image_patches + d.audio_mels + d.video_patches for d in (a, b))
    return (a.input_ids == b.input_ids and a.modality == b.modality and a.image_grids == b.image_grids
            and a.video_grids == b.video_grids and len(inputs_a) == len(inputs_b)
            and all(torch.equal(x, y) for x, y in zip(inputs_a, inputs_b)))


def both_formats(root: Path) -> tuple[ManifestDataset, ManifestDataset]:
    """The same generated samples as a JSONL manifest and as WebDataset shards (each test module's `both`)."""
    jsonl = build_recipe(root / "j", {**SOURCES, "data.synthetic.format": "jsonl"})
    wds = build_recipe(root / "w", SOURCES)
    return open_dataset(jsonl), open_dataset(wds)
