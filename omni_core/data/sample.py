"""The sample model: a sample is an ordered list of segments (text, image, audio) whose token layout is
computable from manifest metadata alone, so packing and profiling never decode a file.

Manifest line (one JSON object per line of manifest.jsonl; paths relative to the manifest's folder):
    {"id": "image-000001", "modality": "image", "segments": [
        {"type": "image", "path": "images/image-000001.png", "width": 40, "height": 24},
        {"type": "text", "text": "a red circle on white."}]}
    audio segments carry "num_samples" and "sample_rate" instead of width/height.
A sample's sequence is BOS + segments + EOS, where text is UTF-8 bytes and every image/audio embedding is one
IMAGE_ID/AUDIO_ID placeholder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_core.data.audio import mel_frames, resampled_length
from omni_core.data.batch import audio_tokens
from omni_core.data.image import patch_grid
from omni_core.data.tokenizer import BOS_ID, EOS_ID, PLACEHOLDER_IDS
from omni_core.recipe.schema import DataConfig

SEGMENT_KINDS = ("text", "image", "audio")
_SIZE_FIELDS = {"text": (), "image": ("width", "height"), "audio": ("num_samples", "sample_rate")}


@dataclass(frozen=True)
class Segment:
    kind: str  # "text" | "image" | "audio"
    text: str = ""  # text segments
    path: str = ""  # image/audio segments, relative to the manifest's folder
    width: int = 0  # image
    height: int = 0
    num_samples: int = 0  # audio, at sample_rate
    sample_rate: int = 0

    def to_json(self) -> dict[str, Any]:
        if self.kind == "text":
            return {"type": "text", "text": self.text}
        return {"type": self.kind, "path": self.path} | {key: getattr(self, key) for key in _SIZE_FIELDS[self.kind]}

    @classmethod
    def from_json(cls, obj: Any) -> Segment:
        """Raises ValueError naming the first missing or ill-typed field."""
        if not isinstance(obj, dict) or obj.get("type") not in SEGMENT_KINDS:
            raise ValueError(f"segment needs a 'type' in {SEGMENT_KINDS}")
        kind = obj["type"]
        if kind == "text":
            if not isinstance(obj.get("text"), str):
                raise ValueError("text segment needs a string 'text'")
            return cls(kind, text=obj["text"])
        if not isinstance(obj.get("path"), str) or not obj["path"]:
            raise ValueError(f"{kind} segment needs a 'path'")
        sizes = {key: obj.get(key) for key in _SIZE_FIELDS[kind]}
        for key, value in sizes.items():
            if type(value) is not int or value <= 0:
                raise ValueError(f"{kind} segment needs a positive integer '{key}'")
        return cls(kind, path=obj["path"], **sizes)


def modality_of(segments: tuple[Segment, ...]) -> str:
    """A sample's modality is its first non-text segment's kind ("text" if none): it selects the loss bucket."""
    return next((seg.kind for seg in segments if seg.kind != "text"), "text")


@dataclass(frozen=True)
class Sample:
    id: str
    modality: str
    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        if self.modality != modality_of(self.segments):
            raise ValueError(f"modality '{self.modality}' does not match its segments ('{modality_of(self.segments)}')")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "modality": self.modality, "segments": [seg.to_json() for seg in self.segments]}

    @classmethod
    def from_json(cls, obj: Any) -> Sample:
        """Raises ValueError for a malformed line; "modality" may be omitted (it follows from the segments)."""
        if not isinstance(obj, dict):
            raise ValueError("line is not a JSON object")
        if not isinstance(obj.get("id"), str) or not obj["id"]:
            raise ValueError("needs a non-empty string 'id'")
        if not isinstance(obj.get("segments"), list) or not obj["segments"]:
            raise ValueError("needs a non-empty list 'segments'")
        segments = tuple(Segment.from_json(seg) for seg in obj["segments"])
        return cls(obj["id"], obj.get("modality", modality_of(segments)), segments)


def segment_tokens(seg: Segment, cfg: DataConfig) -> int:
    """Tokens a segment occupies in the LLM sequence (bytes for text, one per embedding otherwise)."""
    if seg.kind == "text":
        return len(seg.text.encode("utf-8"))
    if seg.kind == "image":
        rows, cols = patch_grid(seg.width, seg.height, cfg.patch_size, cfg.max_image_patches)
        return rows * cols
    return audio_tokens(audio_frames(seg, cfg))


def audio_frames(seg: Segment, cfg: DataConfig) -> int:
    """Log-mel frames of an audio segment once resampled to cfg.sample_rate."""
    return mel_frames(resampled_length(seg.num_samples, seg.sample_rate, cfg.sample_rate), cfg.sample_rate)


def sample_tokens(sample: Sample, cfg: DataConfig) -> int:
    return 2 + sum(segment_tokens(seg, cfg) for seg in sample.segments)


def token_ids(sample: Sample, cfg: DataConfig) -> list[int]:
    """BOS + text bytes / placeholders + EOS: the sample's input ids, built without touching its files."""
    ids = [BOS_ID]
    for seg in sample.segments:
        if seg.kind == "text":
            ids.extend(seg.text.encode("utf-8"))
        else:
            ids.extend([PLACEHOLDER_IDS[seg.kind]] * segment_tokens(seg, cfg))
    ids.append(EOS_ID)
    return ids
