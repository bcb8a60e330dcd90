"""The dynamic source (data.source=dynamic): the synthetic generator's samples drawn on the fly, never stored,
following the mix schedule by the training step each sample is drawn for (see `synthetic` for what a sample
holds and `workload` for how its lengths and modality are drawn)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from omni_core.data.image import frame_indices
from omni_core.data.sample import KINDS, SIZE_FIELDS, Measures, Sample, Segment, measure
from omni_core.data.source_base import Record, Source, Stream, View
from omni_core.data.synthetic import HELDOUT, TRAIN, content, sample_of
from omni_core.data.workload import (
    MODALITY_FIELD,
    MixSchedule,
    Spec,
    check_templates,
    draw_specs,
    pick_modality,
    segments_of,
    uniforms,
)
from omni_core.recipe.data_sections import DataConfig

DRAW_CHUNK = 256  # samples a dynamic stream draws at once (for each modality they may get)


class DynamicSource(Source):
    """Samples drawn on the fly, never stored. Training streams are endless and follow the mix schedule by the
    training step each sample is drawn for; the held-out stream is a fixed pool (heldout_fraction of
    num_samples) at the stationary `mix`. Sample g of a stream (consumer c of C draws g = c, c + C, ...) is a
    pure function of (seed, stream, g, the step it was drawn at)."""

    def __init__(self, cfg: DataConfig) -> None:
        check_templates(cfg.synthetic)
        self.cfg, self.syn = cfg, cfg.synthetic
        self.schedules = {
            TRAIN: MixSchedule(self.syn),
            HELDOUT: MixSchedule(self.syn.model_copy(update={"schedule": [], "bursts": []})),
        }
        self.identity = f"dynamic {json.dumps(self.syn.model_dump(mode='json'), sort_keys=True)}"

    def size(self, view: View) -> int | None:
        """Samples of a one-pass stream over all consumers (None: endless)."""
        if view.split == "heldout":
            return max(1, round(self.syn.num_samples * self.cfg.heldout_fraction))
        return self.syn.num_samples if view.one_pass else None

    def stream(self, view: View, position: list[int] | None, on_skip: Callable[[str], None]) -> Stream:
        return _DynamicStream(self, view, position[0] if position else 0, on_skip)

    def refetch(self, view: View, ref: list[int]) -> Record:
        ordinal, step = ref
        return _DynamicStream(self, view, ordinal).draw(ordinal, step)[0]

    def sample(self, record: Record) -> Sample:
        spec, seed, stream = record.payload
        text, _ = content(spec, seed, stream, self.cfg.sample_rate, with_media=False)
        return sample_of(spec, record.id, text, self.cfg.sample_rate)

    def media(self, record: Record, seg: Segment) -> Any:
        spec, seed, stream = record.payload
        _, media = content(spec, seed, stream, self.cfg.sample_rate, with_media=True)
        if seg.kind == "audio":
            return torch.from_numpy(media.astype(np.float32) / 32768.0), self.cfg.sample_rate  # as soundfile reads
        if seg.kind == "video":  # the frames a file source samples (image.open_video_frames), which measure counts
            return [media[k] for k in frame_indices(spec.frames, self.cfg.video_max_frames)], spec.frames
        return media


class _DynamicStream(Stream):
    """A consumer's samples in order. They are drawn DRAW_CHUNK at a time for every modality they could be
    given (vectorized, and only for the modalities the schedule asks for); the step a sample is drawn at then
    picks which of them it is, so the schedule is followed sample by sample. The position is the next
    sample's ordinal; a pending sample is found again by (ordinal, step)."""

    def __init__(
        self, source: DynamicSource, view: View, ordinal: int, on_skip: Callable[[str], None] | None = None
    ) -> None:
        self.source, self.view, self.ordinal, self.on_skip = source, view, ordinal, on_skip
        self.stream = HELDOUT if view.split == "heldout" else TRAIN
        self.total = source.size(view)
        self.chunk_start = -1
        self.variants: dict[int, tuple[list[Spec], list[list[int]], Measures]] = {}
        self.cumulative: tuple[int, list[float]] = (-1, [])

    def _shares(self, step: int) -> list[float]:
        if self.cumulative[0] != step:
            self.cumulative = (step, np.cumsum(self.source.schedules[self.stream].at(step)).tolist())
        return self.cumulative[1]

    def draw(self, ordinal: int, step: int) -> tuple[Record, str]:
        """Sample `ordinal` as drawn at `step`, and its skip reason ("" if usable)."""
        start = ordinal - ordinal % DRAW_CHUNK
        view, syn, cfg = self.view, self.source.syn, self.source.cfg
        if start != self.chunk_start:
            self.chunk_start, self.variants = start, {}
            self.index = view.consumer + np.arange(start, start + DRAW_CHUNK) * view.consumers
            self.u = uniforms(view.seed, self.stream, self.index, MODALITY_FIELD).tolist()
        i = ordinal - start
        modality = pick_modality(self.u[i], self._shares(step))
        if modality not in self.variants:
            drawn = draw_specs(syn, view.seed, self.stream, self.index, np.full(DRAW_CHUNK, modality))
            sizes = measure(segments_of(drawn, cfg.sample_rate), DRAW_CHUNK, cfg, towers=self.source.towers)
            columns = [getattr(sizes, name).tolist() for name in SIZE_FIELDS]
            self.variants[modality] = (drawn.rows(), columns, sizes)
        specs, columns, sizes = self.variants[modality]
        spec, kind = specs[i], KINDS[modality]
        name = f"{'heldout-' if self.stream == HELDOUT else ''}{kind}-{spec.index:09d}"
        record = Record(
            [ordinal, step],
            ordinal,
            name,
            kind,
            *(c[i] for c in columns),
            segment_tokens=sizes.segment_tokens[i],
            payload=(spec, view.seed, self.stream),
        )
        return record, sizes.problem[i]

    def next(self, step: int) -> Record | None:
        while self.total is None or self.view.consumer + self.ordinal * self.view.consumers < self.total:
            record, problem = self.draw(self.ordinal, step)
            self.ordinal += 1
            if not problem:
                return record
            if self.on_skip is not None:
                self.on_skip(problem)
        return None

    def position(self) -> list[int]:
        return [self.ordinal]
