"""What every sample source shares: the part of a source one consumer reads (`View`), a sample measured but
not decoded (`Record`, and the same as columns, `Sizes`), the `Stream` and `Source` interfaces, and the reasons
a sample is skipped (`SKIP_REASONS`, raised as `CorruptSample`). The sharded sources (`sources`,
`jsonl_source`, `wds_source`) and the generator's dynamic source (`synthetic`) implement them."""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from pathlib import PurePosixPath
from typing import Any, Literal, NamedTuple

import numpy as np

from omni_core.data.sample import Sample, Segment
from omni_core.data.tower_processors import TowerInputs

Split = Literal["train", "heldout", "all"]
SKIP_REASONS = {
    "bad_record": "metadata that does not parse or misses a field (logged with its file and line / key)",
    "missing_file": "a media file or WebDataset member the metadata names is absent",
    "unreadable_file": "bytes that do not decode as what they claim to be",
    "size_mismatch": "a decoded file disagrees with its metadata (which packing trusted)",
    "empty_audio": "an audio clip without samples (or, for a pretrained audio tower, without a pair of frames)",
    "oversized_image": "an image over data.max_image_pixels",
    "truncated_shard": "a tar that ends mid-member: the rest of the shard is lost",
    "lost_sample": "a sample of a truncated shard after where it broke off, counted where the dataset's "
    "shardindex.json (webdataset's wids format) says how many the shard holds",
    "too_long": "a sample longer than data.seq_len",
    "unsafe_path": "a media path that is absolute, a URL, or climbs out of the manifest's folder or data.media_root "
    "(never read)",
    "empty_conversation": "a conversation record without a turn",
    "no_assistant_turn": "a conversation without an assistant reply: nothing to train on",
    "unknown_role": "a turn whose speaker is none of human/user, gpt/assistant, system",
    "media_marker_mismatch": "an <image>/<audio>/<video> marker without its media, or media without a marker",
}


class CorruptSample(Exception):
    """A sample whose bytes are missing, unreadable or disagree with its metadata; `reason` is what loaders
    and the profiler count (one of SKIP_REASONS)."""

    def __init__(self, sample_id: str, where: str, reason: str, detail: str = "") -> None:
        super().__init__(f"sample {sample_id!r}: {where}: {reason}{': ' + detail if detail else ''}")
        self.sample_id, self.where, self.reason = sample_id, where, reason


URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # http:, s3:, data:, file:, and a drive letter


def leaves_folder(path: str) -> bool:
    """Whether a media path could name a file outside the folder it is relative to (or not a file at all)."""
    parts = PurePosixPath(path.replace("\\", "/"))
    return parts.is_absolute() or ".." in parts.parts or bool(URL_SCHEME.match(path))


def in_heldout(sample_id: str, fraction: float) -> bool:
    """Split by a hash of the id, so a sample stays on its side when the data is reordered, resharded or grows."""
    digest = hashlib.sha256(sample_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


@dataclass(frozen=True)
class View:
    """The part of a source one consumer reads, and how."""

    consumer: int
    consumers: int
    split: Split
    seed: int
    one_pass: bool  # False: epochs without end (training)
    shuffle: bool  # reshuffle shard order every epoch


@dataclass(slots=True)
class Record:
    """One sample as a stream delivers it: measured, not decoded. `ref` finds it again after a resume."""

    ref: list[int]
    ordinal: int  # count of records this consumer's stream yielded before it
    id: str
    modality: str
    tokens: int  # LLM tokens; then the rest of sample.SIZE_FIELDS, as `Measures` defines them
    vision_tokens: int
    vision_sq: int
    audio_tokens: int
    audio_sq: int
    audio_frames: int
    image_items: int
    audio_items: int
    video_items: int
    image_llm: int
    video_llm: int
    video_frames: int
    video_patches: int
    _: KW_ONLY  # the sizes above are passed positionally, as columns in SIZE_FIELDS order; these by name
    segment_tokens: list[int]
    payload: Any  # the source's own: (Sample, where its media are) / the generator's choices


class Sizes(NamedTuple):
    """Records' measured sizes as columns (one entry per record, as in `Record`): what the profile reads."""

    modality: np.ndarray  # codes into KINDS; then sample.SIZE_FIELDS
    tokens: np.ndarray
    vision_tokens: np.ndarray
    vision_sq: np.ndarray
    audio_tokens: np.ndarray
    audio_sq: np.ndarray
    audio_frames: np.ndarray
    image_items: np.ndarray
    audio_items: np.ndarray
    video_items: np.ndarray
    image_llm: np.ndarray
    video_llm: np.ndarray
    video_frames: np.ndarray
    video_patches: np.ndarray


class Stream(ABC):
    """One consumer's records in order; `position()` is where the next one starts (JSON-able)."""

    @abstractmethod
    def next(self, step: int) -> Record | None:
        """The next record (None at the end of a one-pass stream); `step` is the training step it is drawn
        for, which only a scheduled (dynamic) source uses."""

    @abstractmethod
    def position(self) -> list[int]: ...


class Source(ABC):
    """Where samples come from. `identity` is what a saved loader position must match."""

    identity: str
    # the recipe's pretrained towers' inputs, which `sample.measure` prices media by (dataset.open_source)
    towers: TowerInputs | None = None

    @abstractmethod
    def stream(self, view: View, position: list[int] | None, on_skip: Callable[[str], None]) -> Stream: ...

    @abstractmethod
    def refetch(self, view: View, ref: list[int]) -> Record:
        """The record a previous stream yielded under `ref` (resumed loaders re-read their pending samples)."""

    @abstractmethod
    def sample(self, record: Record) -> Sample:
        """The record's full sample, text included."""

    @abstractmethod
    def media(self, record: Record, seg: Segment) -> Any:
        """A media segment decoded: a PIL image, (waveform, rate), or (sampled frames, clip frame count);
        raises CorruptSample."""

    def where(self, record: Record, seg: Segment) -> str:
        """Where a segment's bytes live, for messages."""
        return record.id
