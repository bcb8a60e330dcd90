"""A dataset: its source (chosen by data.source) plus decoding of the records the source streams.

Decoding turns a record into a `DecodedSample` (input ids and encoder inputs) and checks every file against
the metadata that packing trusted; any failure is one exception type, `CorruptSample`, that loaders and the
profiler count and skip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from PIL import Image

from omni_core.common.tokenizer import BYTE_TOKENIZER, PAD_ID, Tokenizer, tokenizer_for
from omni_core.data.audio import log_mel, resample
from omni_core.data.conversation import NoRenderer, chat_renderer
from omni_core.data.dynamic_source import DynamicSource
from omni_core.data.image import patchify
from omni_core.data.jsonl_source import JsonlSource
from omni_core.data.sample import Segment, token_ids, trainable_mask
from omni_core.data.source_base import CorruptSample, Record, Source
from omni_core.data.synthetic import ensure_dataset
from omni_core.data.tower_processors import TowerInputs
from omni_core.data.wds_source import WdsSource
from omni_core.recipe.data_sections import DataConfig
from omni_core.recipe.schema import Recipe

__all__ = ["CorruptSample", "DecodedSample", "ManifestDataset", "Split"]

Split = Literal["train", "heldout"]


@dataclass
class DecodedSample:
    """One document of a packed sequence: input ids plus the encoder inputs its placeholders stand for."""

    input_ids: list[int]
    modality: str = "text"  # the loss bucket (batch.MODALITY_IDS)
    image_patches: list[torch.Tensor] = field(default_factory=list)  # [rows*cols, 3*p*p] each
    image_grids: list[tuple[int, int]] = field(default_factory=list)
    audio_mels: list[torch.Tensor] = field(default_factory=list)  # [frames, n_mels] each
    video_patches: list[torch.Tensor] = field(default_factory=list)  # [frames*rows*cols, 3*p*p] each, frame by frame
    video_grids: list[tuple[int, int, int]] = field(default_factory=list)  # (sampled frames, rows, cols)
    is_padding: bool = False
    trainable: list[bool] | None = None  # a conversation's targets (sample.trainable_mask); None: every text token

    @classmethod
    def padding(cls, length: int, pad_id: int = PAD_ID) -> DecodedSample:
        """`length` tokens of nothing (collate lays them out as padding documents of the batch's pad id)."""
        return cls([pad_id] * length, is_padding=True)


def open_source(
    location: str, cfg: DataConfig, tokenizer: Tokenizer = BYTE_TOKENIZER, towers: TowerInputs | None = None
) -> Source:
    """The source at `location`, counting text in `tokenizer`'s tokens (conversation records render with its
    chat template) and media as the pretrained `towers` take them."""
    kind = cfg.synthetic.format if cfg.source == "synthetic" else cfg.source
    if kind == "dynamic":
        if tokenizer is not BYTE_TOKENIZER:
            raise ValueError(
                f"data.source=dynamic draws its text's length in bytes, which {tokenizer.name}'s tokens are not: "
                "with model.pretrained.llm, write the synthetic data (data.synthetic.format: jsonl or wds) or "
                "give data.path"
            )
        dynamic = DynamicSource(cfg)
        dynamic.towers = towers
        return dynamic
    source = (JsonlSource if kind == "jsonl" else WdsSource)(location, cfg)
    source.towers = towers
    source.tokenizer = tokenizer
    source.render = chat_renderer(tokenizer, cfg.train_on_prompt)
    if cfg.format == "conversation" and source.render is None:
        raise NoRenderer(f"data.format is conversation, but {tokenizer.name} has no chat template to render it")
    return source


class ManifestDataset:
    """The dataset at `location` (what `synthetic.ensure_dataset` returns): a JSONL manifest or WebDataset
    shards, local or on S3, or the dynamic generator. (The name is data v0's, when a manifest was the only
    source; the runtime constructs it as ManifestDataset(location, recipe.data).)"""

    def __init__(
        self,
        location: str | Path,
        cfg: DataConfig,
        tokenizer: Tokenizer = BYTE_TOKENIZER,
        towers: TowerInputs | None = None,
    ) -> None:
        self.location, self.cfg, self.tokenizer, self.towers = str(location), cfg, tokenizer, towers
        self.source = open_source(self.location, cfg, tokenizer, towers)

    def __repr__(self) -> str:
        return f"ManifestDataset({self.location!r})"

    def decode(self, record: Record) -> DecodedSample:
        """Reads and featurises a record's media; raises CorruptSample instead of any I/O or format error."""
        sample = self.source.sample(record)
        doc = DecodedSample(token_ids(sample, record.segment_tokens, self.tokenizer), sample.modality)
        doc.trainable = trainable_mask(sample, record.segment_tokens)
        for seg in sample.segments:
            if seg.kind == "text":
                continue
            media = self.source.media(record, seg)
            if seg.kind == "image":
                self._check(record, seg, f"{media.width}x{media.height}", f"{seg.width}x{seg.height}")
                patches, grid = self._patches(media, self.cfg.max_image_patches, self.cfg.min_image_patches)
                doc.image_patches.append(patches)
                doc.image_grids.append(grid)
            elif seg.kind == "video":
                frames, total = media
                self._check(
                    record,
                    seg,
                    f"{frames[0].width}x{frames[0].height}, {total} frames",
                    f"{seg.width}x{seg.height}, {seg.num_frames} frames",
                )
                per_frame = [self._patches(frame, self.cfg.video_frame_patches) for frame in frames]
                doc.video_patches.append(torch.cat([p for p, _ in per_frame]))
                doc.video_grids.append((len(frames), *per_frame[0][1]))  # frames of one clip share their size
            else:
                wave, rate = media
                self._check(
                    record,
                    seg,
                    f"{len(wave)} samples at {rate} Hz",
                    f"{seg.num_samples} samples at {seg.sample_rate} Hz",
                )
                doc.audio_mels.append(self._features(resample(wave, rate, self.cfg.sample_rate)))
        return doc

    def _patches(
        self, img: Image.Image, max_patches: int, min_patches: int = 1
    ) -> tuple[torch.Tensor, tuple[int, int]]:
        """An image's (or video frame's) patches and grid: as the vision tower's processor makes them, where
        the recipe has one, else omni's NaViT patches; `sample.measure` counts the same grid."""
        if self.towers is not None and self.towers.vision is not None:
            return self.towers.vision.patches(img, self.cfg.patch_size)
        return patchify(img, self.cfg.patch_size, max_patches, min_patches)

    def _features(self, wave: torch.Tensor) -> torch.Tensor:
        """A clip's features at data.sample_rate (which `TowerInputs.check_data` holds to the audio tower's)."""
        if self.towers is not None and self.towers.audio is not None:
            return self.towers.audio.features(wave)
        return log_mel(wave, self.cfg.sample_rate, self.cfg.n_mels)

    def _check(self, record: Record, seg: Segment, actual: str, expected: str) -> None:
        """The packer trusted the metadata's sizes; a file that disagrees would break the placeholder count."""
        if actual != expected:
            raise CorruptSample(
                record.id,
                self.source.where(record, seg),
                "size_mismatch",
                f"file has {actual}, metadata says {expected}",
            )


def open_dataset(recipe: Recipe) -> ManifestDataset:
    """The recipe's dataset, generated first when it is synthetic and not on disk yet (`ensure_dataset`)."""
    return ManifestDataset(ensure_dataset(recipe), recipe.data, tokenizer_for(recipe), TowerInputs.of_recipe(recipe))
