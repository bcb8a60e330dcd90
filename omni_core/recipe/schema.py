"""Typed schema of a recipe: one YAML file describes a whole experiment pipeline.

Every section is strict (unknown keys are rejected) so that a typo fails at `omni recipe check`
instead of silently falling back to a default in the middle of a run; so is every number and switch
(`StrictInt`, `StrictFloat`, which still takes an int, `StrictBool`): `steps: true` or `steps: '30'` is an
error, not 1 step or 30. Sections that later stages (estimate, schedule, 5D parallelism) will consume are
typed here already; the runtime refuses values it cannot execute yet instead of ignoring them.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

Modality = Literal["text", "image", "audio", "video"]
MODALITIES: tuple[str, ...] = ("text", "image", "audio", "video")
MAX_SEQ_LEN = 1 << 20  # tokens per packed sequence at most: past any context the flavors are built for
MAX_STEPS = 100_000_000  # optimizer steps at most: ~100x the longest published pre-training run; more is a typo
MAX_SAMPLES = 100_000_000  # synthetic samples at most: a quarter of C4.en's documents, each a file or shard entry
MAX_LOCAL_RANKS = 1024  # torchrun ranks on one machine at most: past any node's GPUs or cores
ModelPart = Literal["vision", "audio", "projectors", "llm"]  # OmniModel's modules, what model.freeze names
MODEL_PARTS: tuple[str, ...] = get_args(ModelPart)


_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")


def redact_userinfo(text: str) -> str:
    """`text` with any URL's user:password@ replaced by ***@, for messages and logs."""
    return _USERINFO.sub(r"\g<scheme>***@", text)


def _no_credentials(value: str | None) -> str | None:
    """Refuse a URL carrying user:password@: a recipe is logged as params, artifacts and flow-run parameters."""
    if value and _USERINFO.search(value):
        raise ValueError(
            f"{redact_userinfo(value)} carries credentials: recipes are logged (MLflow params, "
            "recipe.yaml, flow-run parameters); give them through the environment "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_USERNAME / _PASSWORD)"
        )
    return value


NoCredentials = Annotated[str, AfterValidator(_no_credentials)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ExperimentConfig(Strict):
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="MLflow experiment name, run-name prefix and a path component: letters, digits, _ . -",
    )
    description: str = ""
    seed: StrictInt = Field(0, description="Seed for data generation, model init and data order")
    output_dir: str = Field("runs", description="Local root for generated data and checkpoints")


class Range(Strict):
    """An inclusive integer range, sampled uniformly."""

    min: StrictInt = Field(ge=0)
    max: StrictInt = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


def _check_mix(mix: dict[str, float]) -> None:
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


class SyntheticConfig(Strict):
    """Seeded generator of learnable multimodal samples, written to disk (data.source=synthetic, `omni data
    generate`) or drawn on the fly (data.source=dynamic). The defaults are small, for CPU runs; each length
    field names the public statistic that a real-scale setting mimics (see recipes/dynamic_mix.yaml)."""

    num_samples: StrictInt = Field(
        2000, ge=1, le=MAX_SAMPLES, description="Samples written; dynamic: samples profiled, and held-out pool"
    )
    mix: dict[Modality, StrictFloat] = Field(
        default_factory=lambda: {"text": 0.4, "image": 0.4, "audio": 0.2},
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
        "jsonl: a manifest (a .jsonl file or a folder holding manifest.jsonl); wds: WebDataset shards (a .tar "
        "or a folder of them); both local or s3://bucket/key; dynamic: drawn on the fly from data.synthetic, "
        "following its schedule by training step",
    )
    path: NoCredentials = Field("", description="Dataset location, local or s3:// (default: <output_dir>/data/<name>)")
    s3_endpoint_url: NoCredentials = Field(
        "", description="S3-compatible endpoint such as MinIO (http://minio:9000); empty: $AWS_ENDPOINT_URL or AWS"
    )
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)
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


class ModelConfig(Strict):
    flavor: str = Field("debug", description="Name in the model flavor registry")
    freeze: list[ModelPart] = Field(default_factory=list)

    @field_validator("freeze")
    @classmethod
    def _something_to_train(cls, freeze: list[str]) -> list[str]:
        if set(freeze) >= set(MODEL_PARTS):
            raise ValueError(
                f"every part of the model is frozen ({', '.join(MODEL_PARTS)}): nothing is left to "
                "train (the optimizer would get no parameters)"
            )
        return freeze


ENCODER_LAYOUTS = ("coupled", "omni", "disaggregated")
ENCODER_SCHEDULES = ("phased", "joint")
PLAN_DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "pp_schedule", "cp", "cp_kind", "ep")


ENCODER_SPEC_DEFAULTS = {"lssp": 1, "long_tokens": 0, "long_mb": 0, "fsdp": False}


def encoder_layout_problems(layout: str, ranks: int, specs: dict[str, dict], schedule: str = "phased") -> list[str]:
    """Every problem of an encoder layout, each naming its `encoders.` field; shared by the recipe and by
    `common.plan.EncoderPlan` (a plan read back from its name)."""
    if layout not in ENCODER_LAYOUTS:
        return [f"encoders.layout={layout!r} must be one of {', '.join(ENCODER_LAYOUTS)}"]
    out = []
    for encoder, spec in specs.items():
        out.extend(
            f"encoders.{encoder}.{key}={spec[key]} must be >= {least}"
            for key, least in (("lssp", 1), ("long_tokens", 0), ("long_mb", 0))
            if spec[key] < least
        )
        if spec["lssp"] > 1 and not (spec["long_tokens"] or spec["long_mb"]):
            out.append(f"encoders.{encoder}.lssp={spec['lssp']} needs a long-item threshold (long_tokens or long_mb)")
        if layout == "coupled" and spec != ENCODER_SPEC_DEFAULTS:
            out.append(
                f"encoders.{encoder} is set, which needs layout omni or disaggregated: coupled encoders "
                "run on their LLM stage's batches as they come"
            )
    if layout == "disaggregated" and ranks < 1:
        out.append("encoders.ranks must be >= 1 under layout disaggregated (the encoders' own ranks)")
    if layout != "disaggregated" and ranks:
        out.append(f"encoders.ranks={ranks} needs layout disaggregated (layout is {layout})")
    if schedule not in ENCODER_SCHEDULES:
        out.append(f"encoders.schedule={schedule!r} must be one of {', '.join(ENCODER_SCHEDULES)}")
    elif schedule == "joint" and layout == "coupled":
        out.append(
            "encoders.schedule=joint needs layout omni or disaggregated: coupled encoders already run inside "
            "the first pipeline stage, per micro-batch"
        )
    return out


class EncoderSpecConfig(Strict):
    """One encoder's layout over its group (omni and disaggregated layouts)."""

    lssp: StrictInt = Field(1, ge=1, description="Ranks a long item is split over (long-short sequence parallelism)")
    long_tokens: StrictInt = Field(
        0, ge=0, description="An item with more encoder tokens (patches, mel frames) is long; 0: no threshold by cost"
    )
    long_mb: StrictInt = Field(
        0, ge=0, description="An item whose encoder activations exceed this many MiB is long; 0: no threshold by memory"
    )
    fsdp: StrictBool = Field(
        False,
        description="Shard the encoder's weights over its group, its blocks gathered one at a time (else replicated)",
    )


class EncodersConfig(Strict):
    """Where the encoders run (DESIGN.md §3): coupled (the LLM's first stage, Megatron-LLaVA), omni (every rank,
    their own balanced layout, MegaScale-Omni) or disaggregated (ranks of their own, DistTrain)."""

    layout: Literal["coupled", "omni", "disaggregated"] = "coupled"
    ranks: StrictInt = Field(0, ge=0, description="disaggregated: ranks the encoders get (the LLM gets the rest)")
    vision: EncoderSpecConfig = EncoderSpecConfig()
    audio: EncoderSpecConfig = EncoderSpecConfig()
    schedule: Literal["phased", "joint"] = Field(
        "phased",
        description="phased: the step's encoder forward, the LLM, the encoder backward; joint: the "
        "encoders per micro-batch in the ranks' idle time, embeddings handed off as they are made (omni, disaggregated)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> EncodersConfig:
        problems = encoder_layout_problems(
            self.layout,
            self.ranks,
            {"vision": self.vision.model_dump(), "audio": self.audio.model_dump()},
            self.schedule,
        )
        if problems:
            raise ValueError("; ".join(problems))
        return self


class ParallelConfig(Strict):
    """Degrees of the LLM's 5D layout; their product with dp is the world size."""

    nproc: StrictInt = Field(
        1, ge=1, le=MAX_LOCAL_RANKS, description="Local ranks started by torchrun (--nproc-per-node)"
    )
    plan: Literal["explicit", "auto"] = Field(
        "explicit",
        description="explicit: the degrees below; auto: the estimate stage's best plan for the Cell "
        "the train stage has (this machine's device type x nproc), with its micro-batch, gradient accumulation "
        "(the global batch kept) and activation checkpointing; the degrees below must then stay unset",
    )
    dp_replicate: StrictInt = Field(1, ge=1)
    dp_shard: StrictInt = Field(-1, ge=-1, description="-1: whatever is left of the world after the other degrees")
    tp: StrictInt = Field(1, ge=1)
    pp: StrictInt = Field(1, ge=1)
    pp_schedule: Literal["1F1B", "Interleaved1F1B", "GPipe"] = "1F1B"
    cp: StrictInt = Field(1, ge=1)
    cp_kind: Literal["ulysses", "ring"] = "ulysses"
    ep: StrictInt = Field(1, ge=1)
    encoders: EncodersConfig = EncodersConfig()
    backend: Literal["auto", "gloo", "nccl"] = "auto"

    @model_validator(mode="after")
    def _dp_shard_set_or_derived(self) -> ParallelConfig:
        if self.dp_shard == 0:
            raise ValueError("dp_shard must be -1 (derived from the world size) or >= 1")
        return self

    @model_validator(mode="after")
    def _auto_leaves_the_degrees_unset(self) -> ParallelConfig:
        given = [k for k in PLAN_DEGREES if getattr(self, k) != type(self).model_fields[k].default]
        if self.plan == "auto" and given:
            raise ValueError(
                f"plan is auto, so the estimate stage chooses {', '.join(given)}: drop "
                f"{'them' if len(given) > 1 else 'it'}, or set parallel.plan=explicit to run them"
            )
        return self


class NodeGroup(Strict):
    gpu_type: str
    nodes: StrictInt = Field(ge=1)
    gpus_per_node: StrictInt = Field(ge=1)
    interconnect: str = Field("", description="Link between nodes, e.g. ib-200g (informational for the scheduler)")
    hosts: list[str] = Field(
        default_factory=list,
        description="The nodes' Slurm names, one per node: `omni schedule` with launch.target "
        "slurm pins each launch to the nodes it placed the job on (sbatch --nodelist)",
    )

    @model_validator(mode="after")
    def _a_host_per_node(self) -> NodeGroup:
        if self.hosts and len(self.hosts) != self.nodes:
            raise ValueError(f"hosts names {len(self.hosts)} node(s), nodes={self.nodes}: give one name per node")
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError(f"hosts {self.hosts} names a node twice")
        return self


class ClusterConfig(Strict):
    name: str = "local"
    node_groups: list[NodeGroup] = Field(default_factory=list, description="Empty: this machine only")
    slots: StrictInt = Field(
        0,
        ge=0,
        description="This machine as a cluster (node_groups empty): CPU slots, one rank each, for "
        "`omni schedule`; 0: the CPU count rounded down to a power of two",
    )

    @model_validator(mode="after")
    def _slots_power_of_two(self) -> ClusterConfig:
        if self.slots & (self.slots - 1):
            raise ValueError(f"slots={self.slots} must be a power of two (jobs take 1, 2, 4, ... slots)")
        return self


class JobConfig(Strict):
    name: str
    model: str = Field(description="Model flavor or trace model name, e.g. bert__1.3B")
    global_batch: StrictInt = Field(ge=1, description="Samples per step (a model flavor: packed sequences)")
    iterations: StrictInt = Field(ge=1, description="Steps to train (`omni schedule`: the job's train.steps)")
    arrival_s: StrictFloat = Field(0.0, ge=0, description="Submission time (`omni schedule`: seconds after it starts)")
    deadline_s: StrictFloat | None = None
    gpu_type: str | None = Field(None, description="User-requested GPU type (baselines use it)")
    num_gpus: StrictInt | None = Field(None, ge=1)


class EstimateConfig(Strict):
    """The estimate stage (Crius Cells): which GPUs to price the recipe's jobs on, and catalogue overrides."""

    gpu_types: list[str] = Field(
        default_factory=lambda: ["cpu"], description="GPU types to estimate on when cluster.node_groups is empty"
    )
    max_gpus: StrictInt = Field(4, ge=1, description="Largest Cell (GPUs) per type when cluster.node_groups is empty")
    layout: Literal["omni", "coupled"] = Field("omni", description="Where MLLM encoders run (see DESIGN.md §3)")
    precision: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="Training precision of the recipe's model")
    gpus: dict[str, dict[str, StrictFloat]] = Field(
        default_factory=dict,
        description="GPU catalogue overrides or new types, e.g. {a100: {nic_bw: 4.0e11}} (fields of GpuSpec)",
    )
    validation: Literal["quick", "full"] = Field(
        "quick", description="`omni validate`: 10 plans in one round (~2 min) or 30 plans in three rounds (~20 min)"
    )


class ScheduleConfig(Strict):
    policy: Literal["crius", "fcfs", "gavel", "sia"] = "crius"
    round_s: StrictFloat = Field(300.0, gt=0)
    max_rounds: StrictInt = Field(2000, ge=1)
    policies: list[Literal["crius", "fcfs", "gavel", "sia"]] = Field(
        default_factory=list, description="Policies `omni simulate` compares side by side; empty: [policy]"
    )
    trace: str = Field("", description="Job trace CSV replayed by `omni simulate`; empty: the recipe's jobs")
    trace_format: Literal["auto", "crius", "itp", "philly"] = "auto"
    trace_seed: StrictInt = Field(0, description="Seed of the mapping from raw trace rows to model jobs")
    trace_keep: StrictFloat = Field(1.0, gt=0, le=1, description="Seeded share of raw-trace jobs kept")
    trace_start_s: StrictFloat = Field(
        0.0, ge=0, description="Replay from this many seconds after the trace's first arrival"
    )
    restart_s: StrictFloat = Field(60.0, ge=0, description="Seconds a job loses at each (re)start: re-plan, restore")
    iteration_scale: StrictFloat = Field(
        1.0,
        ge=1,
        le=1000,
        description="`omni simulate` divides every job's iterations by this (the Crius artifact "
        "simulates its trace with 5)",
    )
    arrival_compression: StrictFloat = Field(
        1.0,
        ge=1,
        le=1000,
        description="`omni simulate` divides every arrival time by this: 10 packs the trace's "
        "arrivals ten times closer (a contention study)",
    )
    fixed_horizon: StrictBool = Field(
        False,
        description="`omni simulate` runs every policy for exactly max_rounds rounds (the Crius artifact's "
        "convention); false: until the last job ends",
    )
    busy_min_throughput: StrictFloat = Field(
        100.0,
        ge=0,
        description="The busy-round throughput average counts only rounds above this many samples/s "
        "(the Crius artifact: 100)",
    )
    max_gpus_per_job: StrictInt = Field(32, ge=1)
    segment_steps: StrictInt = Field(
        50,
        ge=1,
        description="`omni schedule`: steps a job trains per launch; each segment's end (a checkpoint) "
        "is where the scheduler may resize the job",
    )


class TrainConfig(Strict):
    steps: StrictInt = Field(100, ge=1, le=MAX_STEPS)
    lr: StrictFloat = Field(3e-3, gt=0)
    min_lr_ratio: StrictFloat = Field(0.1, ge=0, le=1, description="Cosine floor as a share of lr")
    warmup_steps: StrictInt = Field(10, ge=0)
    weight_decay: StrictFloat = Field(0.01, ge=0)
    betas: tuple[StrictFloat, StrictFloat] = (0.9, 0.95)
    grad_clip: StrictFloat = Field(1.0, ge=0, description="0 disables clipping")
    grad_accum: StrictInt = Field(1, ge=1)
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Autocast compute dtype; auto: bfloat16 on GPUs that support it, else float32"
    )
    activation_checkpointing: StrictBool = Field(False, description="Recompute transformer blocks in backward")
    compile: StrictBool = Field(
        False, description="torch.compile each transformer block (pays off on GPUs, not on CPU)"
    )
    log_every: StrictInt = Field(10, ge=1)
    ckpt_every: StrictInt = Field(50, ge=0, description="0: only the final checkpoint")
    keep_last: StrictInt = Field(2, ge=1)
    resume: StrictBool = Field(True, description="Continue from the newest complete checkpoint in ckpt_dir")
    max_restarts: StrictInt = Field(
        0,
        ge=0,
        le=100,
        description="torchrun restarts every rank after one fails, this many times; each restart "
        "resumes from the newest complete checkpoint",
    )
    launch_retries: StrictInt = Field(
        1,
        ge=0,
        le=10,
        description="The train stage launches torchrun again (resuming the newest checkpoint) this "
        "many times when a launch fails from outside the code (a rank killed: OOM killer, a lost node), never for "
        "a rank's own error or the wall-clock limit",
    )
    stop_at_step: StrictInt = Field(
        0,
        ge=0,
        description="Stop (with a checkpoint) at this step; 0: train.steps. The LR schedule still spans "
        "train.steps: this is how a scheduler runs a job in segments",
    )
    ckpt_dir: NoCredentials = Field(
        "", description="Default: <output_dir>/<experiment>/ckpt-<training hash>, see Recipe.training_hash"
    )
    timeout_s: StrictFloat = Field(3600.0, gt=0, description="Wall-clock limit of the torchrun launch")
    dist_timeout_s: StrictFloat = Field(
        300.0, gt=0, description="Process-group timeout, so a dead rank fails the others"
    )

    @model_validator(mode="after")
    def _betas_in_range(self) -> TrainConfig:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas {self.betas} must each be in [0, 1)")
        return self


class LaunchConfig(Strict):
    """Where the train stage starts torchrun: on this machine (`local`), or as a Slurm batch job (`slurm`: the
    `sbatch` of `runtime.targets.slurm_script`, on a cluster whose nodes share this filesystem)."""

    target: Literal["local", "slurm"] = Field("local", description="local: a process group here; slurm: sbatch")
    nodes: StrictInt = Field(1, ge=1, description="Nodes of the launch (slurm); parallel.nproc ranks split over them")
    nodelist: list[str] = Field(
        default_factory=list,
        description="Slurm nodes to run on (sbatch --nodelist), one "
        "per node; empty: Slurm chooses. `omni schedule` sets it from its placement",
    )
    partition: NoCredentials = Field("", description="Slurm partition; empty: the cluster's default")
    cpus_per_node: StrictInt = Field(0, ge=0, description="CPUs a node's task asks for; 0: one per rank")
    memory_gb: StrictInt = Field(8, ge=1)
    gpus_per_node: StrictInt = Field(0, ge=0)
    poll_s: StrictFloat = Field(2.0, gt=0, description="How often a Slurm job's state and output are read")

    @model_validator(mode="after")
    def _nodes_fit_the_target(self) -> LaunchConfig:
        if self.target == "local" and self.nodes > 1:
            raise ValueError(f"nodes={self.nodes} needs target slurm: a local launch is this one machine")
        if self.nodelist and (self.target != "slurm" or len(self.nodelist) != self.nodes):
            raise ValueError(
                f"nodelist {self.nodelist} names Slurm nodes, one per node: it needs target slurm "
                f"and nodes={len(self.nodelist)}"
            )
        return self


class EvalConfig(Strict):
    max_batches: StrictInt = Field(50, ge=1, description="Held-out packed sequences per rank to evaluate")
    generate_samples: StrictInt = Field(16, ge=0, description="Held-out documents per modality captioned greedily")
    max_new_tokens: StrictInt = Field(64, ge=1, description="Decoding budget per caption/transcript")


class TrackingConfig(Strict):
    uri: NoCredentials | None = Field(
        None, description="MLflow tracking URI; default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db"
    )
    experiment: str | None = Field(None, description="MLflow experiment; default: experiment.name")
    flush_every_s: StrictFloat = Field(2.0, gt=0, description="Metric batches are sent at most this often")
    reconnect_timeout_s: StrictFloat = Field(
        300.0,
        ge=0,
        description="After training, how long the train stage waits for an MLflow server that is away "
        "before it gives up logging the checkpoint (metrics and run statuses are kept and sent later)",
    )
    registered_model: str = Field(
        "", description="Model Registry name for the final checkpoint; default: experiment.name"
    )
    model_alias: str = Field(
        "current", pattern=r"^[A-Za-z0-9_-]+$", description="Alias moved to each newly registered version"
    )

    @model_validator(mode="after")
    def _alias_not_reserved(self) -> TrackingConfig:
        if re.fullmatch(r"latest|v\d+", self.model_alias, flags=re.IGNORECASE):
            raise ValueError(f"model_alias {self.model_alias!r} is reserved by MLflow ('latest', 'v<N>')")
        return self


class ReplanConfig(Strict):
    """The watcher that re-plans a running job when its data drifts (scheduler/replan.py)."""

    enabled: StrictBool = Field(False, description="The train stage watches its own job and re-plans it")
    drift_threshold: StrictFloat = Field(
        0.15,
        gt=0,
        description="Re-estimate when the newest window has drifted this far from the profile the "
        "running plan was chosen on: the total-variation distance of the modality mix, or the relative change "
        "of the mean training FLOPs per sample, whichever is larger",
    )
    window: StrictInt = Field(200, ge=10, description="Samples of the job's newest data profiled at each look")
    every_steps: StrictInt = Field(0, ge=0, description="Steps between the watcher's looks; 0: train.ckpt_every")
    cost_s: StrictFloat = Field(
        0.0,
        ge=0,
        description="Seconds one re-plan costs (checkpoint, restart, first steps); 0: measured on "
        "the running launch (from its launch to its first step, plus its last checkpoint's save)",
    )
    max_replans: StrictInt = Field(4, ge=0, description="Re-plans per job at most")
    layouts: list[Literal["coupled", "omni"]] = Field(
        ["coupled", "omni"], min_length=1, description="Encoder layouts the watcher chooses among"
    )


class Recipe(Strict):
    experiment: ExperimentConfig
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    jobs: list[JobConfig] = Field(default_factory=list)
    estimate: EstimateConfig = Field(default_factory=EstimateConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    replan: ReplanConfig = Field(default_factory=ReplanConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    @model_validator(mode="after")
    def _ranks_split_over_nodes(self) -> Recipe:
        if self.parallel.nproc % self.launch.nodes:
            raise ValueError(
                f"launch.nodes={self.launch.nodes} must divide parallel.nproc={self.parallel.nproc} (ranks per node)"
            )
        return self

    @model_validator(mode="after")
    def _replan_has_stops(self) -> Recipe:
        if self.replan.enabled and not self.train.ckpt_every:
            raise ValueError("replan.enabled needs train.ckpt_every > 0: a re-planned job stops at a checkpoint")
        if self.replan.enabled and self.jobs:
            raise ValueError("replan.enabled is for one job; a recipe with `jobs` is re-planned by its scheduler")
        return self

    def data_dir(self) -> str:
        return self.data.path or f"{self.experiment.output_dir}/data/{self.experiment.name}"

    def checkpoint_dir(self) -> str:
        return self.train.ckpt_dir or f"{self.experiment.output_dir}/{self.experiment.name}/ckpt-{self.training_hash()}"

    def training_hash(self) -> str:
        """Hash of what determines the trained model (seed, data, model, optimisation).

        Keys the default checkpoint directory: rerunning a recipe resumes (or finds it finished), while a
        changed model or schedule starts afresh instead of loading incompatible or foreign state.
        Operational settings (logging, checkpoint cadence, timeouts, evaluation, tracking) are left out, and
        so is the parallel layout: checkpoints reshard between plans, so a job resized by the scheduler (or
        rerun on more ranks) resumes its own checkpoint; the data order then restarts.
        """
        operational = {
            "stop_at_step",
            "resume",
            "max_restarts",
            "launch_retries",
            "timeout_s",
            "dist_timeout_s",
            "log_every",
            "ckpt_every",
            "keep_last",
            "ckpt_dir",
            "activation_checkpointing",
            "compile",
        }
        identity = {
            "seed": self.experiment.seed,
            "data": self.data.model_dump(mode="json", exclude=PROFILE_ONLY | {"s3_endpoint_url"}),
            "model": self.model.model_dump(mode="json"),
            "train": self.train.model_dump(mode="json", exclude=operational),
        }
        return _short_hash(identity)

    def mlflow_experiment(self) -> str:
        return self.tracking.experiment or self.experiment.name


PROFILE_ONLY = {"profile_max_samples", "profile_window", "drift_threshold", "profile_decode"}


def recipe_hash(recipe: Recipe) -> str:
    """Identity of what will run: equal resolved recipes hash equal whatever their files or key order."""
    return _short_hash(recipe.model_dump(mode="json"))


def _short_hash(obj: Any) -> str:
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]
