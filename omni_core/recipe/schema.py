"""Typed schema of a recipe: one YAML file describes a whole experiment pipeline.

Every section is strict (unknown keys are rejected) so that a typo fails at `omni recipe check`
instead of silently falling back to a default in the middle of a run. Sections that later stages
(estimate, schedule, 5D parallelism) will consume are typed here already; the runtime refuses values
it cannot execute yet instead of ignoring them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Modality = Literal["text", "image", "audio"]
MODALITIES: tuple[str, ...] = ("text", "image", "audio")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ExperimentConfig(Strict):
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="MLflow experiment name, run-name prefix and a path component: letters, digits, _ . -",
    )
    description: str = ""
    seed: int = Field(0, description="Seed for data generation, model init and data order")
    output_dir: str = Field("runs", description="Local root for generated data and checkpoints")


class Range(Strict):
    """An inclusive integer range, sampled uniformly."""

    min: int = Field(ge=0)
    max: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


class SyntheticConfig(Strict):
    """Seeded generator of a learnable on-disk multimodal dataset (JSONL + PNG + WAV)."""

    num_samples: int = Field(2000, ge=1)
    mix: dict[Modality, float] = Field(
        default_factory=lambda: {"text": 0.4, "image": 0.4, "audio": 0.2},
        description="Share of samples whose non-text segment is of each modality",
    )
    text_words: Range = Field(default_factory=lambda: Range(min=4, max=24))
    image_side_px: Range = Field(default_factory=lambda: Range(min=16, max=48))
    audio_ms: Range = Field(default_factory=lambda: Range(min=200, max=800))

    @model_validator(mode="after")
    def _mix_positive(self) -> SyntheticConfig:
        if not self.mix or sum(self.mix.values()) <= 0 or min(self.mix.values()) < 0:
            raise ValueError("mix needs non-negative shares with a positive sum")
        return self


class DataConfig(Strict):
    source: Literal["synthetic", "jsonl"] = Field(
        "synthetic", description="synthetic: generate into `path` if it has no manifest; jsonl: read `path`"
    )
    path: str = Field("", description="Dataset directory holding manifest.jsonl (default: <output_dir>/data/<name>)")
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)
    heldout_fraction: float = Field(0.05, gt=0, lt=1, description="Share of samples kept for evaluation")
    seq_len: int = Field(512, ge=16, description="Token budget of one packed sequence")
    micro_batch: int = Field(1, ge=1, description="Packed sequences per rank per micro-step")
    patch_size: int = Field(8, ge=1, description="Image patch side in pixels")
    max_image_patches: int = Field(64, ge=1, description="Images with more patches are downscaled")
    sample_rate: int = Field(16000, ge=1000)
    n_mels: int = Field(32, ge=4)
    profile_max_samples: int = Field(0, ge=0, description="0 = profile every sample")


class ModelConfig(Strict):
    flavor: str = Field("debug", description="Name in the model flavor registry")
    freeze: list[Literal["vision", "audio", "projectors", "llm"]] = Field(default_factory=list)


class ParallelConfig(Strict):
    """Degrees of the LLM's 5D layout; their product with dp is the world size."""

    nproc: int = Field(1, ge=1, description="Local ranks started by torchrun (--nproc-per-node)")
    dp_replicate: int = Field(1, ge=1)
    dp_shard: int = Field(-1, ge=-1, description="-1: whatever is left of the world after the other degrees")
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    pp_schedule: Literal["1F1B", "Interleaved1F1B", "GPipe"] = "1F1B"
    cp: int = Field(1, ge=1)
    cp_kind: Literal["ulysses", "ring"] = "ulysses"
    ep: int = Field(1, ge=1)
    backend: Literal["auto", "gloo", "nccl"] = "auto"

    @model_validator(mode="after")
    def _dp_shard_set_or_derived(self) -> ParallelConfig:
        if self.dp_shard == 0:
            raise ValueError("dp_shard must be -1 (derived from the world size) or >= 1")
        return self


class NodeGroup(Strict):
    gpu_type: str
    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)


class ClusterConfig(Strict):
    name: str = "local"
    node_groups: list[NodeGroup] = Field(default_factory=list, description="Empty: this machine only")


class JobConfig(Strict):
    name: str
    model: str = Field(description="Model flavor or trace model name, e.g. bert__1.3B")
    global_batch: int = Field(ge=1)
    iterations: int = Field(ge=1)
    arrival_s: float = Field(0.0, ge=0)
    deadline_s: float | None = None
    gpu_type: str | None = Field(None, description="User-requested GPU type (baselines use it)")
    num_gpus: int | None = Field(None, ge=1)


class ScheduleConfig(Strict):
    policy: Literal["crius", "fcfs", "gavel", "sia"] = "crius"
    round_s: float = Field(300.0, gt=0)
    max_rounds: int = Field(2000, ge=1)


class TrainConfig(Strict):
    steps: int = Field(100, ge=1)
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine floor as a share of lr")
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, ge=0, description="0 disables clipping")
    grad_accum: int = Field(1, ge=1)
    log_every: int = Field(10, ge=1)
    ckpt_every: int = Field(50, ge=0, description="0: only the final checkpoint")
    keep_last: int = Field(2, ge=1)
    resume: bool = Field(True, description="Continue from the newest complete checkpoint in ckpt_dir")
    ckpt_dir: str = Field(
        "", description="Default: <output_dir>/<experiment>/ckpt-<training hash>, see Recipe.training_hash"
    )
    timeout_s: float = Field(3600.0, gt=0, description="Wall-clock limit of the torchrun launch")
    dist_timeout_s: float = Field(300.0, gt=0, description="Process-group timeout, so a dead rank fails the others")

    @model_validator(mode="after")
    def _betas_in_range(self) -> TrainConfig:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas {self.betas} must each be in [0, 1)")
        return self


class EvalConfig(Strict):
    max_batches: int = Field(50, ge=1, description="Held-out packed sequences per rank to evaluate")


class TrackingConfig(Strict):
    uri: str | None = Field(None, description="MLflow tracking URI; default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db")
    experiment: str | None = Field(None, description="MLflow experiment; default: experiment.name")
    flush_every_s: float = Field(2.0, gt=0, description="Metric batches are sent at most this often")


class Recipe(Strict):
    experiment: ExperimentConfig
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    jobs: list[JobConfig] = Field(default_factory=list)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    def data_dir(self) -> str:
        return self.data.path or f"{self.experiment.output_dir}/data/{self.experiment.name}"

    def checkpoint_dir(self) -> str:
        return self.train.ckpt_dir or f"{self.experiment.output_dir}/{self.experiment.name}/ckpt-{self.training_hash()}"

    def training_hash(self) -> str:
        """Hash of what determines the trained weights (seed, data, model, optimisation, world).

        Keys the default checkpoint directory: rerunning a recipe resumes (or finds it finished), while a
        changed model or schedule starts afresh instead of loading incompatible or foreign state.
        Operational settings (logging, checkpoint cadence, timeouts, evaluation, tracking) are left out.
        """
        operational = {"resume", "timeout_s", "dist_timeout_s", "log_every", "ckpt_every", "keep_last", "ckpt_dir"}
        identity = {
            "seed": self.experiment.seed,
            "data": self.data.model_dump(mode="json", exclude={"profile_max_samples"}),
            "model": self.model.model_dump(mode="json"),
            "parallel": self.parallel.model_dump(mode="json", exclude={"backend"}),
            "train": self.train.model_dump(mode="json", exclude=operational),
        }
        return _short_hash(identity)

    def mlflow_experiment(self) -> str:
        return self.tracking.experiment or self.experiment.name


def recipe_hash(recipe: Recipe) -> str:
    """Identity of what will run: equal resolved recipes hash equal whatever their files or key order."""
    return _short_hash(recipe.model_dump(mode="json"))


def _short_hash(obj: Any) -> str:
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]
