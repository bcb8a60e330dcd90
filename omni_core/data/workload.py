"""The synthetic workload's metadata: which modality each sample has and how long it is, drawn vectorized.

Every random choice of sample g is a pure function of (seed, stream, g, field) through a counter-based hash
(splitmix64), not of a sequential generator's state: any chunk of samples can be drawn on its own, in any
order, and comes out identical. That is what lets a loader resume the dynamic stream anywhere, lets several
processes write shards of one dataset, and makes metadata cheap (hundreds of thousands of samples a second).

The mix follows `MixSchedule` by training step; content (pixels, tones, words) is rendered later, from the
same hash, only for samples that are decoded or written (`synthetic.py`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields

import numpy as np

from omni_core.data.sample import KIND_CODE, KINDS, Segments
from omni_core.recipe.data_sections import LengthDist, Modality, SyntheticConfig

SHAPES = ("circle", "square", "triangle")
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (20, 20, 20), "gray": (128, 128, 128)}
DIRECTIONS = ("left", "right", "up", "down")
TONES = {"do": 300.0, "mi": 700.0, "so": 1500.0, "la": 3200.0}  # several mel bins apart
# 160 ms = 16 mel hops = 8 audio embeddings: tone k is embeddings 8k..8k+7, an alignment a debug model picks up
# within ~200 steps (tones of random length, or 6 pitches, were not learned from the audio that fast).
TONE_MS = 160
TEXT_PER_WORD = 3  # text_words -> tokens: the counting template writes 3 bytes per number ("07 ")
MODALITY_CODE = KIND_CODE

# Fields of the per-sample hash; each draw uses its own so that adding one never shifts another.
MODALITY_FIELD, _LEN_A, _LEN_B, _LEN_C, _LEN_D, _LONG, _SHAPE, _COLOR, _BACKGROUND, _DIRECTION = range(10)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective, well-mixed uint64 -> uint64 hash."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(seed: int, stream: int, index: np.ndarray, field: int) -> np.ndarray:
    """U[0, 1) per sample index, independent across (seed, stream, field)."""
    with np.errstate(over="ignore"):
        key = _mix64(np.array([(seed * 0x9E3779B1 + stream * 0x85EBCA77 + field * 0xC2B2AE3D) % 2**64], np.uint64))
        bits = _mix64(np.asarray(index, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + key)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def check_templates(cfg: SyntheticConfig) -> None:
    """The content templates need room (a caption's shape, a tone, a counting phrase), for the modalities the
    mix, schedule or bursts can draw."""
    drawn = {m for mix in [cfg.mix, *(p.mix for p in cfg.schedule)] for m, share in mix.items() if share > 0}
    drawn |= {burst.modality for burst in cfg.bursts}
    least = {
        "text_words": ("text", cfg.text_words, 4),
        "text_tokens": ("text", cfg.text_tokens, 16),
        "image_side_px": ("image", cfg.image_side_px, 4),
        "audio_ms": ("audio", cfg.audio_ms, 20),
        "video_side_px": ("video", cfg.video_side_px, 4),
        "video_frames": ("video", cfg.video_frames, 1),
    }
    for name, (modality, dist, minimum) in least.items():
        if modality in drawn and dist is not None and dist.min < minimum:
            raise ValueError(f"data.synthetic.{name}.min must be >= {minimum} for the generator's templates")


def draw_lengths(dist: LengthDist, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Integer lengths from two uniforms each (the second only feeds the Box-Muller normal)."""
    if dist.kind == "uniform":
        return dist.min + np.minimum((u * (dist.max - dist.min + 1)).astype(np.int64), dist.max - dist.min)
    z = np.sqrt(-2.0 * np.log1p(-u)) * np.cos(2.0 * np.pi * v)
    values = dist.center + dist.spread * z if dist.kind == "normal" else dist.center * np.exp(dist.spread * z)
    return np.clip(np.round(values), dist.min, dist.max).astype(np.int64)


class MixSchedule:
    """Modality shares by training step: `schedule` points interpolated linearly (held before the first and
    after the last), else the stationary `mix`; then every active burst sets its modality's share and scales
    the others to fill the rest."""

    def __init__(self, cfg: SyntheticConfig) -> None:
        def vector(mix: dict[Modality, float]) -> np.ndarray:
            shares = np.zeros(len(KINDS))
            for m, share in mix.items():
                shares[KIND_CODE[m]] = share
            return shares / shares.sum()

        points = cfg.schedule or []
        self.steps = np.array([p.step for p in points] or [0], dtype=np.float64)
        self.shares = np.stack([vector(p.mix) for p in points] or [vector(cfg.mix)])
        self.bursts = [(MODALITY_CODE[b.modality], b.share, b.start, b.steps, b.every) for b in cfg.bursts]
        ends = [start + steps for _, _, start, steps, every in self.bursts if not every]
        periodic = [start + every for _, _, start, _, every in self.bursts if every]  # one full period shown
        self.horizon = int(max([self.steps[-1], *ends, *periodic]))
        self.stationary = len(points) < 2 and not self.bursts

    def at(self, step: np.ndarray | int) -> np.ndarray:
        """[n, modalities] shares at each step (a [modalities] vector for a scalar step)."""
        t = np.asarray(step, dtype=np.float64)
        shares = np.stack([np.interp(t, self.steps, self.shares[:, m]) for m in range(len(KINDS))], axis=-1)
        for m, share, start, steps, every in self.bursts:
            offset = t - start
            active = (offset >= 0) & ((offset % every < steps) if every else (offset < steps))
            others = 1.0 - shares[..., m]
            scale = np.where(others > 0, (1.0 - share) / np.where(others > 0, others, 1.0), 0.0)
            burst = shares * scale[..., None]
            burst[..., m] = np.where(others > 0, share, 1.0)
            shares = np.where(active[..., None], burst, shares)
        return shares


@dataclass
class Specs:
    """What the generator decided for a chunk of samples, one array entry per sample. The content choices
    (shape, colour, ...) are drawn here already because they set the caption's length, hence the tokens."""

    index: np.ndarray  # global sample index: the hash counter
    modality: np.ndarray  # codes into KINDS
    width: np.ndarray  # image / video frame pixels
    height: np.ndarray
    tones: np.ndarray  # audio: 160 ms tones
    frames: np.ndarray  # video: stored frames
    text_tokens: np.ndarray  # text-only samples: exact token count of the document
    shape: np.ndarray
    color: np.ndarray
    background: np.ndarray
    direction: np.ndarray  # video: where the shape moves

    def __len__(self) -> int:
        return len(self.index)

    def rows(self) -> list[Spec]:
        """Per sample, as plain ints: what a record carries and a renderer takes."""
        names = [field.name for field in fields(Spec)]
        return [Spec(*row) for row in zip(*(getattr(self, name).tolist() for name in names))]


@dataclass(frozen=True, slots=True)
class Spec:
    """One sample's `Specs` entry."""

    index: int
    modality: int
    width: int
    height: int
    tones: int
    frames: int
    text_tokens: int
    shape: int
    color: int
    background: int
    direction: int


def draw_modalities(shares: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Categorical draw per sample from its row of shares (or one shared vector): the first modality whose
    cumulative share exceeds the sample's uniform."""
    cumulative = np.cumsum(np.broadcast_to(shares, (len(u), len(KINDS))), axis=-1)
    return np.minimum((u[:, None] >= cumulative).sum(axis=-1), len(KINDS) - 1)


def pick_modality(u: float, cumulative: list[float]) -> int:
    """`draw_modalities` for one sample, given np.cumsum of the shares as a list (no array overhead)."""
    return min(bisect.bisect_right(cumulative, u), len(cumulative) - 1)


def draw_specs(cfg: SyntheticConfig, seed: int, stream: int, index: np.ndarray, modality: np.ndarray) -> Specs:
    """Sizes and content choices of samples whose modality is already decided."""
    index = np.asarray(index, dtype=np.int64)

    def u(field: int) -> np.ndarray:
        return uniforms(seed, stream, index, field)

    a, b, c, d = u(_LEN_A), u(_LEN_B), u(_LEN_C), u(_LEN_D)
    is_video = modality == MODALITY_CODE["video"]
    width = np.where(is_video, draw_lengths(cfg.video_side_px, a, b), draw_lengths(cfg.image_side_px, a, b))
    height = np.where(is_video, draw_lengths(cfg.video_side_px, c, d), draw_lengths(cfg.image_side_px, c, d))
    duration_ms = draw_lengths(cfg.audio_ms, a, b)
    tones = np.clip(np.round(duration_ms / TONE_MS), max(1, -(-cfg.audio_ms.min // TONE_MS)), None).astype(np.int64)
    short = cfg.text_tokens or LengthDist(
        min=TEXT_PER_WORD * cfg.text_words.min + 3, max=TEXT_PER_WORD * cfg.text_words.max + 3
    )
    long_doc = u(_LONG) < cfg.long_doc_share
    text_tokens = np.where(long_doc, draw_lengths(cfg.long_doc_tokens, c, d), draw_lengths(short, c, d))
    return Specs(
        index=index,
        modality=np.asarray(modality, dtype=np.int64),
        width=width,
        height=height,
        tones=tones,
        frames=draw_lengths(cfg.video_frames, c, d),
        text_tokens=text_tokens,
        shape=(u(_SHAPE) * len(SHAPES)).astype(np.int64),
        color=(u(_COLOR) * len(COLORS)).astype(np.int64),
        background=(u(_BACKGROUND) * len(BACKGROUNDS)).astype(np.int64),
        direction=(u(_DIRECTION) * len(DIRECTIONS)).astype(np.int64),
    )


def draw_at_steps(
    cfg: SyntheticConfig, schedule: MixSchedule, seed: int, stream: int, index: np.ndarray, steps: np.ndarray | int
) -> Specs:
    """Samples drawn at the given training steps: modality from the schedule there, then sizes."""
    index = np.asarray(index, dtype=np.int64)
    modality = draw_modalities(schedule.at(steps), uniforms(seed, stream, index, MODALITY_FIELD))
    return draw_specs(cfg, seed, stream, index, modality)


def _name_lengths(names) -> np.ndarray:
    return np.array([len(name) for name in names], dtype=np.int64)


def caption_lengths(specs: Specs) -> np.ndarray:
    """Bytes of each sample's text, exactly as `synthetic.caption` / `synthetic.text_document` write it."""
    shape, color = _name_lengths(SHAPES)[specs.shape], _name_lengths(COLORS)[specs.color]
    image = 2 + color + 1 + shape + 4 + _name_lengths(BACKGROUNDS)[specs.background] + 1  # "a red circle on white."
    video = 2 + color + 1 + shape + 7 + _name_lengths(DIRECTIONS)[specs.direction] + 1  # "a red circle moves left."
    audio = 3 * specs.tones  # "do mi la."
    by_modality = np.stack([specs.text_tokens, image, audio, video])
    return by_modality[specs.modality, np.arange(len(specs))]


def segments_of(specs: Specs, sample_rate: int) -> Segments:
    """The metadata columns `sample.measure` prices: every sample is its media segment (none for text) then
    its text, in that order."""
    n = len(specs)
    media = specs.modality != MODALITY_CODE["text"]
    owner = np.repeat(np.arange(n), np.where(media, 2, 1))
    first = np.concatenate([[0], np.cumsum(np.where(media, 2, 1))[:-1]])
    kind = np.full(len(owner), MODALITY_CODE["text"], dtype=np.int64)
    kind[first[media]] = specs.modality[media]
    width, height, n_samples, rate, frames, text = (np.zeros(len(owner), dtype=np.int64) for _ in range(6))
    for modality in ("image", "video", "audio"):
        mine = specs.modality == MODALITY_CODE[modality]
        rows = first[mine]
        if modality == "audio":
            n_samples[rows], rate[rows] = specs.tones[mine] * TONE_MS * sample_rate // 1000, sample_rate
        else:
            width[rows], height[rows] = specs.width[mine], specs.height[mine]
            frames[rows] = specs.frames[mine] if modality == "video" else 0
    text_rows = np.concatenate([first[~media], first[media] + 1])
    text[text_rows] = caption_lengths(specs)[np.concatenate([np.flatnonzero(~media), np.flatnonzero(media)])]
    return Segments(
        owner=owner,
        kind=kind,
        width=width,
        height=height,
        num_samples=n_samples,
        sample_rate=rate,
        num_frames=frames,
        text_tokens=text,
    )
