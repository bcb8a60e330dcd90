"""The `data` section of a recipe: where samples come from, the synthetic generator and its length
distributions and mix schedule, packing, balancing over data ranks, and the profile's drift settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, model_validator

from omni_core.recipe.base import NoCredentials, Strict

Modality = Literal["text", "image", "audio", "video"]
MODALITIES: tuple[str, ...] = ("text", "image", "audio", "video")
MAX_SEQ_LEN = 1 << 20  # tokens per packed sequence at most: past any context the flavors are built for
MAX_SAMPLES = 100_000_000  # synthetic samples at most: a quarter of C4.en's documents, each a file or shard entry


class Range(Strict):
    """An inclusive integer range, sampled uniformly."""

    min: StrictInt = Field(ge=0)
    max: StrictInt = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


def _check_mix(mix: dict[Modality, float]) -> None:
    if not mix or sum(mix.values()) <= 0 or min(mix.values()) < 0:
        raise ValueError("mix needs non-negative shares with a positive sum")


class LengthDist(Range):
    """An integer length: uniform on [min, max], or normal / log-normal clipped to [min, max]."""

    kind: Literal["uniform", "normal", "lognormal"] = "uniform"
    center: StrictFloat = Field(0.0, ge=0, description="normal: mean; lognormal: median; unused by uniform")
    spread: StrictFloat = Field(0.0, ge=0, description="normal: standard deviation; lognormal: sigma of the log")

    @model_validator(mode="after")
    def _shaped(self) -> LengthDist:
        if self.kind != "uniform" and not (self.min <= self.center <= self.max and self.spread > 0):
            raise ValueError(f"{self.kind} needs min <= center <= max and spread > 0")
        return self


class MixPoint(Strict):
    step: StrictInt = Field(ge=0, description="Training (optimizer) step, whatever the plan's micro-batches")
    mix: dict[Modality, StrictFloat]

    @model_validator(mode="after")
    def _mix_positive(self) -> MixPoint:
        _check_mix(self.mix)
        return self


class MixBurst(Strict):
    """`modality` takes `share` of the samples for `steps` steps from `start`, again every `every` steps (0: once);
    the other modalities keep their proportions in the rest."""

    modality: Modality
    share: StrictFloat = Field(gt=0, le=1)
    start: StrictInt = Field(ge=0)
    steps: StrictInt = Field(ge=1)
    every: StrictInt = Field(0, ge=0)

    @model_validator(mode="after")
    def _period(self) -> MixBurst:
        if self.every and self.every <= self.steps:
            raise ValueError(f"every ({self.every}) must be 0 or longer than steps ({self.steps})")
        return self


def _default_mix() -> dict[Modality, float]:
    """SyntheticConfig.mix unless a recipe sets one."""
    return {"text": 0.4, "image": 0.4, "audio": 0.2}


class SyntheticConfig(Strict):
    """Seeded generator of learnable multimodal samples, written to disk (data.source=synthetic, `omni data
    generate`) or drawn on the fly (data.source=dynamic). The defaults are small, for CPU runs; each length
    field names the public statistic that a real-scale setting mimics (see recipes/dynamic_mix.yaml)."""

    num_samples: StrictInt = Field(
        2000, ge=1, le=MAX_SAMPLES, description="Samples written; dynamic: samples profiled, and held-out pool"
    )
    mix: dict[Modality, StrictFloat] = Field(
        default_factory=_default_mix,
        description="Share of samples whose non-text segment is of each modality",
    )
    schedule: list[MixPoint] = Field(
        default_factory=list,
        description="Mix by training step, linear between points, held outside them; empty: `mix` throughout. "
        "Written datasets spread the schedule's steps evenly over their samples, in order",
    )
    bursts: list[MixBurst] = Field(default_factory=list, description="Temporary surges of one modality")
    text_words: Range = Field(
        default_factory=lambda: Range(min=4, max=24), description="Words of a text-only sample if text_tokens is unset"
    )
    text_tokens: LengthDist | None = Field(
        None,
        description="Tokens of a text-only sample (unset: 3 per text_words word + 3). Web text: C4.en holds 156B "
        "tokens in 365M documents, 427 per document on average (Dodge et al. 2021); its spread is ours",
    )
    long_doc_share: StrictFloat = Field(
        0.0, ge=0, le=1, description="Share of text-only samples that are long documents"
    )
    long_doc_tokens: LengthDist = Field(
        default_factory=lambda: LengthDist(min=32768, max=131072),
        description="Tokens of a long document. PG-19: 28,752 books averaging 69k words, ~90k tokens (Rae et al. 2019)",
    )
    image_side_px: LengthDist = Field(
        default_factory=lambda: LengthDist(min=16, max=48),
        description="Image width and height, drawn independently. COCO 2017: longest side 640 px, the other "
        "mostly 427-480 px (640x480, 640x427 and their portrait forms)",
    )
    audio_ms: LengthDist = Field(
        default_factory=lambda: LengthDist(min=200, max=800),
        description="Clip duration, in whole 160 ms tones. LibriSpeech train-clean-100: 100.6 h in 28,539 "
        "utterances, mean 12.7 s, cut at silences into segments of at most 35 s",
    )
    video_frames: LengthDist = Field(
        default_factory=lambda: LengthDist(min=4, max=8),
        description="Frames stored per clip at 1 frame/s. MSR-VTT: 10,000 clips of 10-30 s, 41.2 h (mean 14.8 s)",
    )
    video_side_px: LengthDist = Field(
        default_factory=lambda: LengthDist(min=16, max=32), description="Frame width and height. MSR-VTT: 320x240"
    )
    format: Literal["jsonl", "wds"] = Field(
        "jsonl", description="On disk: a JSONL manifest beside media files, or WebDataset .tar shards"
    )
    shard_size: StrictInt = Field(1000, ge=1, description="Samples per WebDataset shard")

    @model_validator(mode="after")
    def _mix_positive(self) -> SyntheticConfig:
        _check_mix(self.mix)
        return self

    @model_validator(mode="after")
    def _schedule_ordered(self) -> SyntheticConfig:
        steps = [point.step for point in self.schedule]
        if steps != sorted(set(steps)):
            raise ValueError(f"schedule steps must increase strictly, got {steps}")
        return self


class BalanceConfig(Strict):
    """How training batches are balanced over data ranks (MegaScale-Omni's grouped reordering)."""

    policy: Literal["none", "grouped", "global"] = Field(
        "grouped",
        description="none: each rank packs its own stream by tokens; grouped: the loaders of a group "
        "of data ranks place their shared window by predicted cost (encoders + LLM) onto every member's step; "
        "global: one group of all data ranks (OrchMLLM-like)",
    )
    group_size: StrictInt = Field(
        0, ge=0, description="Data ranks per group under grouped (0: those of one node); must divide the data ranks"
    )


class DataConfig(Strict):
    source: Literal["synthetic", "jsonl", "wds", "dynamic"] = Field(
        "synthetic",
        description="synthetic: generate into `path` (in synthetic.format) unless there already, then read it; "
        "jsonl: a manifest (a .jsonl file, a .json file holding an array of records, or a folder holding "
        "manifest.jsonl or *.jsonl / *.json files); wds: WebDataset shards (a .tar "
        "or a folder of them); both local or s3://bucket/key; dynamic: drawn on the fly from data.synthetic, "
        "following its schedule by training step",
    )
    path: NoCredentials = Field("", description="Dataset location, local or s3:// (default: <output_dir>/data/<name>)")
    s3_endpoint_url: NoCredentials = Field(
        "", description="S3-compatible endpoint such as MinIO (http://minio:9000); empty: $AWS_ENDPOINT_URL or AWS"
    )
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)
    format: Literal["auto", "segments", "conversation"] = Field(
        "auto",
        description="How jsonl/wds records are read: segments (omni's metadata records), conversation (LLaVA, "
        "ShareGPT or OpenAI `messages` records, see docs/data.md), or auto: each record by its keys",
    )
    train_on_prompt: StrictBool = Field(
        False, description="Conversations: loss on every turn's tokens (false: on the assistant replies only)"
    )
    media_root: NoCredentials = Field(
        "",
        description="The folder the media paths of .json/.jsonl records are relative to, local or s3:// (empty: "
        "the manifest's folder); absolute paths, URLs and paths climbing out of it are skipped as unsafe_path",
    )
    heldout_fraction: StrictFloat = Field(0.05, gt=0, lt=1, description="Share of samples kept for evaluation")
    seq_len: StrictInt = Field(512, ge=16, le=MAX_SEQ_LEN, description="Token budget of one packed sequence")
    micro_batch: StrictInt = Field(1, ge=1, description="Packed sequences per rank per micro-step")
    pack_lookahead: StrictFloat = Field(
        1.5, ge=1, le=8, description="Pending samples the packer picks from, in batches' worth of tokens"
    )
    num_workers: StrictInt = Field(
        0, ge=0, description="Decoding processes per rank (0: decode in the training process); changes data order"
    )
    balance: BalanceConfig = Field(default_factory=BalanceConfig)
    patch_size: StrictInt = Field(8, ge=1, description="Image patch side in pixels")
    max_image_patches: StrictInt = Field(64, ge=1, description="Images with more patches are downscaled")
    min_image_patches: StrictInt = Field(1, ge=1, description="Images with fewer patches are upscaled")
    max_image_pixels: StrictInt = Field(
        50_000_000, ge=1, description="Images with more pixels are skipped as oversized (decompression-bomb guard)"
    )
    video_max_frames: StrictInt = Field(8, ge=1, description="Frames sampled evenly from a video clip")
    video_frame_patches: StrictInt = Field(16, ge=1, description="Patch budget of one sampled video frame")
    sample_rate: StrictInt = Field(16000, ge=1000)
    n_mels: StrictInt = Field(32, ge=4)
    profile_max_samples: StrictInt = Field(
        0, ge=0, description="Profile the first N samples of the stream (0: all; dynamic: synthetic.num_samples)"
    )
    profile_window: StrictInt = Field(1000, ge=10, description="Samples per drift window of the profile")
    drift_threshold: StrictFloat = Field(
        0.1,
        gt=0,
        lt=1,
        description="A window drifts when the KS statistic of its token lengths, or the total-variation distance "
        "of its mix, against the first window exceeds this (and the KS test is significant at 0.1%)",
    )
    profile_decode: StrictBool = Field(
        False, description="Profile by decoding every sample: finds bad files, times decoding"
    )

    @model_validator(mode="after")
    def _patch_budget(self) -> DataConfig:
        if self.min_image_patches > self.max_image_patches:
            raise ValueError(
                f"min_image_patches ({self.min_image_patches}) exceeds max_image_patches ({self.max_image_patches})"
            )
        return self
