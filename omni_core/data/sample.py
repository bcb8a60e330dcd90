"""The sample model: a sample is an ordered list of segments (text, image, audio, video) whose token layout is
computable from metadata alone, so packing and profiling never decode a file.

Metadata record (a line of a JSONL manifest, or a WebDataset sample's `key.json`):
    {"id": "image-000001", "modality": "image", "segments": [
        {"type": "image", "path": "images/image-000001.png", "width": 40, "height": 24},
        {"type": "text", "text": "a red circle on white."}]}
Media segments name their file by `path`: relative to the manifest's folder in a JSONL manifest, the member's
extension ("png", "0.jpg", "txt") in a WebDataset sample. Audio carries "num_samples" and "sample_rate",
video (an animated GIF/WebP: sampled frames) "width", "height" and "num_frames".

A segment sample's sequence is BOS (where the tokenizer has one) + segments + EOS; a conversation's is its chat
template's rendering (conversation.chat_renderer). Text is the recipe's tokenizer's ids,
every image patch, audio embedding or video embedding (sampled frames merged in time and space,
`batch.video_tokens`) as one placeholder of its kind.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np

from omni_core.common.batch import audio_tokens, video_tokens
from omni_core.common.tokenizer import BYTE_TOKENIZER, Tokenizer
from omni_core.data.audio import mel_frames, resampled_length
from omni_core.data.image import patch_grid, sampled_frames
from omni_core.data.tower_processors import TowerInputs
from omni_core.models.args import OmniModelArgs
from omni_core.recipe.data_sections import MODALITIES, DataConfig

KINDS = MODALITIES  # segment kinds; a sample's modality is the kind of its first non-text segment
KIND_CODE = {k: i for i, k in enumerate(KINDS)}
# per media kind, the sizes its metadata carries: (position in a Segment's fields, key, least value)
_SIZES = {
    "image": ((3, "width", 1), (4, "height", 1)),
    "audio": ((5, "num_samples", 0), (6, "sample_rate", 1)),  # an empty clip is skipped later: empty_audio
    "video": ((3, "width", 1), (4, "height", 1), (7, "num_frames", 1)),
}
# The model's merges that a video's placeholders count by. DataConfig names no flavor, so these are OmniModelArgs'
# defaults, which the flavors that train on data keep (debug, debug-moe, small); images likewise take one
# placeholder per patch, spatial_merge 1. A flavor that differs fails at its first batch, in OmniModel.embed.
TEMPORAL_MERGE, SPATIAL_MERGE = OmniModelArgs.temporal_merge, OmniModelArgs.spatial_merge
SegmentFields = tuple[str, str, str, int, int, int, int, int]  # a Segment's fields, in order


@dataclass(slots=True)
class Segment:
    kind: str  # one of KINDS
    text: str = ""  # text segments
    path: str = ""  # media file (see the module docstring); for text, a WebDataset member holding it
    width: int = 0  # image, video
    height: int = 0
    num_samples: int = 0  # audio, at sample_rate
    sample_rate: int = 0
    num_frames: int = 0  # video

    def to_json(self) -> dict[str, Any]:
        if self.kind == "text":
            return {"type": "text", "path": self.path} if self.path else {"type": "text", "text": self.text}
        return {"type": self.kind, "path": self.path} | {key: getattr(self, key) for _, key, _ in _SIZES[self.kind]}

    def fields(self) -> SegmentFields:
        return (
            self.kind,
            self.text,
            self.path,
            self.width,
            self.height,
            self.num_samples,
            self.sample_rate,
            self.num_frames,
        )


def segment_fields(obj: Any) -> SegmentFields:
    """A metadata segment's fields, validated (no Segment is built: the metadata profile needs none); raises
    ValueError naming the first missing or ill-typed field."""
    kind = obj.get("type") if type(obj) is dict else None
    if kind == "text":
        text, path = obj.get("text"), obj.get("path", "")
        if type(text) is str and not path:
            return ("text", text, "", 0, 0, 0, 0, 0)
        if type(path) is str and path and text is None:
            return ("text", "", path, 0, 0, 0, 0, 0)
        raise ValueError("text segment needs a string 'text' (or, in a WebDataset sample, a member 'path')")
    if type(kind) is not str or kind not in _SIZES:
        raise ValueError(f"segment needs a 'type' in {KINDS}")
    sizes = _SIZES[kind]
    path = obj.get("path", "")
    if type(path) is not str or not path:
        raise ValueError(f"{kind} segment needs a string 'path'")
    sized = [0, 0, 0, 0, 0]  # the fields from width on
    for at, key, least in sizes:
        value = obj.get(key)
        if type(value) is not int or value < least:
            raise ValueError(f"{kind} segment needs an integer '{key}' >= {least}")
        sized[at - 3] = value
    width, height, num_samples, sample_rate, num_frames = sized
    return (kind, "", path, width, height, num_samples, sample_rate, num_frames)


def modality_of(kinds: Iterable[str]) -> str:
    """A sample's modality is its first non-text segment's kind ("text" if none): it selects the loss bucket."""
    for kind in kinds:
        if kind != "text":
            return kind
    return "text"


def record_fields(obj: Any) -> tuple[str, str, list[SegmentFields]]:
    """(id, modality, segment fields) of a metadata record; raises ValueError for a malformed one. "modality"
    may be omitted (it follows from the segments)."""
    if type(obj) is not dict:
        raise ValueError("record is not a JSON object")
    sample_id, segments = obj.get("id"), obj.get("segments")
    if type(sample_id) is not str or not sample_id:
        raise ValueError("needs a non-empty string 'id'")
    if type(segments) is not list or not segments:
        raise ValueError("needs a non-empty list 'segments'")
    fields = [segment_fields(seg) for seg in segments]
    modality = modality_of([f[0] for f in fields])
    if "modality" in obj and obj["modality"] != modality:
        raise ValueError(f"modality '{obj['modality']}' does not match its segments ('{modality}')")
    return sample_id, modality, fields


class Rendered(NamedTuple):
    """A conversation rendered by its chat template: ids holding one placeholder per media segment (at `media_at`,
    in the order of the sample's media segments), and whether each id is a training target (a reply's token)."""

    ids: list[int]
    trainable: list[bool]
    media_at: list[int]


@dataclass(slots=True)
class Sample:
    id: str
    modality: str
    segments: list[Segment]
    # a conversation (data/conversation.py): its ids come from here, its segments are its media then one
    # empty text segment that stands for the rendered text (whose tokens SegmentRows.add is told)
    rendered: Rendered | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "modality": self.modality, "segments": [seg.to_json() for seg in self.segments]}

    @classmethod
    def from_json(cls, obj: Any) -> Sample:
        """Raises ValueError for a malformed record (see `record_fields`)."""
        return cls.of_fields(*record_fields(obj))

    @classmethod
    def of_fields(cls, sample_id: str, modality: str, fields: list[SegmentFields]) -> Sample:
        return cls(sample_id, modality, [Segment(*f) for f in fields])


@dataclass
class Segments:
    """Metadata columns over the segments of a chunk of samples, sample after sample: what `measure` prices.
    Sources fill it from parsed samples (`of`); the generator fills it vectorized, before any text exists."""

    owner: np.ndarray  # index of the segment's sample within the chunk (non-decreasing)
    kind: np.ndarray  # codes into KINDS
    width: np.ndarray
    height: np.ndarray
    num_samples: np.ndarray
    sample_rate: np.ndarray
    num_frames: np.ndarray
    text_tokens: np.ndarray  # tokens of text segments under the tokenizer

    @classmethod
    def of(cls, samples: Sequence[Sample], tokenizer: Tokenizer = BYTE_TOKENIZER) -> Segments:
        rows = SegmentRows(tokenizer)
        for sample in samples:
            rows.add([seg.fields() for seg in sample.segments])
        return rows.segments()


class SegmentRows:
    """`Segments` gathered sample by sample as one flat int64 buffer: a source adds each parsed record's
    segment fields, without keeping a Segment (or a tuple) per segment. Texts are counted in `tokenizer`'s
    tokens all at once, when the columns are built."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.flat = array("q")
        self.samples = 0
        self.texts: list[str] = []  # texts still to count, and where their counts go in `flat`
        self.text_slots: list[int] = []

    def add(self, fields: Iterable[SegmentFields], text_tokens: int | None = None) -> None:
        """`text_tokens`: the text's tokens, counted already (a rendered conversation's one text segment)."""
        owner = self.samples
        for kind, text, _, width, height, num_samples, sample_rate, num_frames in fields:
            if kind == "text" and text_tokens is None:
                self.texts.append(text)
                self.text_slots.append(len(self.flat) + 7)
            self.flat.extend(
                (
                    owner,
                    KIND_CODE[kind],
                    width,
                    height,
                    num_samples,
                    sample_rate,
                    num_frames,
                    (text_tokens or 0) if kind == "text" else 0,
                )
            )
        self.samples += 1

    def segments(self) -> Segments:
        flat = np.array(self.flat, dtype=np.int64)
        flat[self.text_slots] = self.tokenizer.lengths(self.texts)
        return Segments(*flat.reshape(-1, 8).T)


@dataclass
class Measures:
    """Sizes of a chunk of samples, from metadata alone (one array entry per sample)."""

    tokens: np.ndarray  # LLM tokens: BOS + text tokens + placeholders + EOS
    vision_tokens: np.ndarray  # patches of its images and sampled video frames
    vision_sq: np.ndarray  # sum over images and frames of patches^2: the ViT's attention work
    audio_tokens: np.ndarray  # audio encoder tokens (its LLM placeholders: these over model.audio_pool)
    audio_sq: np.ndarray  # sum over clips of outputs^2
    audio_frames: np.ndarray  # log-mel frames: the audio encoder's convolution input
    image_items: np.ndarray  # its images, clips and videos
    audio_items: np.ndarray
    video_items: np.ndarray
    image_llm: np.ndarray  # LLM placeholders of its images; video_llm: of its videos (image projector outputs both)
    video_llm: np.ndarray
    video_frames: np.ndarray  # sampled frames of its videos
    video_patches: np.ndarray  # their patches (part of vision_tokens)
    problem: list[str]  # per sample: "" or why it cannot be used ("oversized_image", "empty_audio")
    segment_owner: np.ndarray  # per segment (as in `Segments`): its sample
    segment_llm: np.ndarray  # per segment: its LLM tokens

    @cached_property
    def segment_tokens(self) -> list[list[int]]:
        """Per sample, LLM tokens of each segment: built on first use, as the metadata profile needs none."""
        bounds = np.searchsorted(self.segment_owner, np.arange(len(self.tokens) + 1)).tolist()
        flat = self.segment_llm.tolist()
        return [flat[a:b] for a, b in pairwise(bounds)]

    @property
    def encoder_tokens(self) -> np.ndarray:
        return self.vision_tokens + self.audio_tokens


# A sample's sizes, in the order `sources.Record` and `sources.Sizes` carry them.
SIZE_FIELDS = (
    "tokens",
    "vision_tokens",
    "vision_sq",
    "audio_tokens",
    "audio_sq",
    "audio_frames",
    "image_items",
    "audio_items",
    "video_items",
    "image_llm",
    "video_llm",
    "video_frames",
    "video_patches",
)


def _grid(
    towers: TowerInputs | None,
    width: np.ndarray,
    height: np.ndarray,
    cfg: DataConfig,
    max_patches: int,
    min_patches: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of images (or video frames) of these sizes: the vision tower's fixed grid where there is one
    (`tower_processors.SiglipImageProcessing.patches`), else omni's NaViT grid (`image.patchify`)."""
    if towers is None or towers.vision is None:
        return patch_grid(width, height, cfg.patch_size, max_patches, min_patches)
    rows, cols = towers.vision.grid(cfg.patch_size)
    return np.full_like(width, rows), np.full_like(width, cols)


def _audio_frames(
    towers: TowerInputs | None, num_samples: np.ndarray, rates: np.ndarray, cfg: DataConfig
) -> np.ndarray:
    """Feature frames of clips resampled to data.sample_rate: the audio tower's extractor's where there is one
    (`WhisperFeatures.features`, which cuts a clip at its chunk), else `audio.log_mel`'s."""
    resampled = resampled_length(num_samples, rates, cfg.sample_rate)
    if towers is None or towers.audio is None:
        return mel_frames(resampled, cfg.sample_rate)
    return towers.audio.feature_frames(resampled)


def frame_tokens(tokenizer: Tokenizer) -> int:
    """Ids that frame a segment sample: its BOS (where the tokenizer has one) and its EOS. A rendered
    conversation brings its own framing, so its text count is told net of these (`rendered_text_tokens`)."""
    return (tokenizer.bos_id is not None) + 1


def rendered_text_tokens(rendered: Rendered, media_segments: int, tokenizer: Tokenizer) -> int:
    """The text count `measure` is told for a rendered conversation: its ids but the media placeholders, net
    of the frame `measure` adds to every sample, so that a record's tokens are its document's length."""
    return len(rendered.ids) - media_segments - frame_tokens(tokenizer)


def measure(
    segs: Segments,
    size: int,
    cfg: DataConfig,
    tokenizer: Tokenizer = BYTE_TOKENIZER,
    towers: TowerInputs | None = None,
) -> Measures:
    """Token counts of the chunk's `size` samples, vectorized: the one token rule that packing, profiling and
    decoding share (`segs` counted text in `tokenizer`'s tokens; its BOS, if any, and EOS frame each sample;
    images and audio as the pretrained `towers` take them, where the recipe has any)."""
    w, h, n, f = segs.width, segs.height, segs.num_samples, segs.num_frames
    llm = segs.text_tokens.copy()
    vision, vision_sq, aud, aud_sq, mels, shown = (np.zeros_like(llm) for _ in range(6))

    img = segs.kind == KIND_CODE["image"]
    rows, cols = _grid(towers, w[img], h[img], cfg, cfg.max_image_patches, cfg.min_image_patches)
    llm[img] = vision[img] = rows * cols
    vision_sq[img] = (rows * cols) ** 2

    vid = segs.kind == KIND_CODE["video"]
    rows, cols = _grid(towers, w[vid], h[vid], cfg, cfg.video_frame_patches)
    shown[vid] = sampled_frames(f[vid], cfg.video_max_frames)
    vision[vid] = shown[vid] * rows * cols
    vision_sq[vid] = shown[vid] * (rows * cols) ** 2
    llm[vid] = video_tokens(shown[vid], rows, cols, TEMPORAL_MERGE, SPATIAL_MERGE)

    au = segs.kind == KIND_CODE["audio"]
    mels[au] = _audio_frames(towers, n[au], segs.sample_rate[au], cfg)
    aud[au] = audio_tokens(mels[au])  # the encoder's tokens (its cost); the LLM's after its pool
    llm[au] = audio_tokens(mels[au], 1 if towers is None else towers.audio_pool)
    aud_sq[au] = aud[au] ** 2

    def per_sample(values: np.ndarray) -> np.ndarray:
        return np.bincount(segs.owner, weights=values, minlength=size).astype(np.int64)

    oversized = per_sample(((img | vid) & (w * h > cfg.max_image_pixels)).astype(np.int64)) > 0
    # no embedding: an empty clip, or one too short for the tower's extractor (under two hops) or the pool
    empty = per_sample((au & ((n == 0) | (llm == 0))).astype(np.int64)) > 0
    problem = [""] * size
    for i in np.flatnonzero(oversized | empty).tolist():
        problem[i] = "oversized_image" if oversized[i] else "empty_audio"
    return Measures(
        tokens=frame_tokens(tokenizer) + per_sample(llm),
        vision_tokens=per_sample(vision),
        vision_sq=per_sample(vision_sq),
        audio_tokens=per_sample(aud),
        audio_sq=per_sample(aud_sq),
        audio_frames=per_sample(mels),
        image_items=per_sample(img),
        audio_items=per_sample(au),
        video_items=per_sample(vid),
        image_llm=per_sample(llm * img),
        video_llm=per_sample(llm * vid),
        video_frames=per_sample(shown),
        video_patches=per_sample(vision * vid),
        problem=problem,
        segment_owner=segs.owner,
        segment_llm=llm,
    )


def token_ids(sample: Sample, segment_tokens: Sequence[int], tokenizer: Tokenizer = BYTE_TOKENIZER) -> list[int]:
    """BOS (if the tokenizer has one) + text ids / placeholders + EOS: the sample's input ids, given its measured
    segment sizes."""
    if sample.rendered is not None:  # framed by its template (conversation.chat_renderer)
        return _expanded(sample, segment_tokens, sample.rendered.ids)
    ids = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    for seg, count in zip(sample.segments, segment_tokens, strict=True):
        if seg.kind == "text":
            ids.extend(tokenizer.encode(seg.text))
        else:
            ids.extend([tokenizer.placeholder_ids[seg.kind]] * count)
    ids.append(tokenizer.eos_id)
    return ids


def trainable_mask(sample: Sample, segment_tokens: Sequence[int]) -> list[bool] | None:
    """Per id of `token_ids`, whether it is a training target; None for a segment sample (every text token and
    EOS is, packing.document_labels). Placeholders never are; the rest as the conversation's rendering says."""
    if sample.rendered is None:
        return None
    return _expanded(sample, segment_tokens, sample.rendered.trainable, placeholder_value=False)


def _expanded(
    sample: Sample, segment_tokens: Sequence[int], values: Sequence[Any], placeholder_value: Any = None
) -> list[Any]:
    """A rendered conversation's per-id `values` with each media placeholder repeated by its media's measured
    count (as `placeholder_value`, or the placeholder id itself)."""
    assert sample.rendered is not None
    counts = [count for seg, count in zip(sample.segments, segment_tokens, strict=True) if seg.kind != "text"]
    media_at = sample.rendered.media_at
    if len(counts) != len(media_at):
        raise ValueError(f"sample {sample.id!r}: {len(counts)} media segments but {len(media_at)} placeholders")
    out: list[Any] = []
    start = 0
    for at, count in zip(media_at, counts):
        out += values[start:at]
        out += [values[at] if placeholder_value is None else placeholder_value] * count
        start = at + 1
    out += values[start:]
    return out
