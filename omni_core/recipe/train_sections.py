"""The sections of one training run: optimisation and checkpointing (`train`), where torchrun starts
(`launch`), evaluation (`eval`) and MLflow tracking (`tracking`)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from omni_core.recipe.base import NoCredentials, Strict
from omni_core.recipe.model_sections import ModelPart

MAX_STEPS = 100_000_000  # optimizer steps at most: ~100x the longest published pre-training run; more is a typo


class TrainConfig(Strict):
    steps: StrictInt = Field(100, ge=1, le=MAX_STEPS)
    lr: StrictFloat = Field(3e-3, gt=0)
    min_lr_ratio: StrictFloat = Field(0.1, ge=0, le=1, description="Cosine floor as a share of lr")
    warmup_steps: StrictInt = Field(10, ge=0)
    weight_decay: StrictFloat = Field(0.01, ge=0)
    lr_by_part: dict[ModelPart, Annotated[StrictFloat, Field(gt=0)]] = Field(
        default_factory=dict,
        description="Peak learning rate per part of the model (vision, audio, projectors, llm), e.g. "
        "{projectors: 1e-3, llm: 2e-5}; the parts not named take train.lr. Beside model.freeze",
    )
    weight_decay_by_part: dict[ModelPart, Annotated[StrictFloat, Field(ge=0)]] = Field(
        default_factory=dict,
        description="Weight decay of a part's matrices; the parts not named take train.weight_decay",
    )
    betas: tuple[StrictFloat, StrictFloat] = (0.9, 0.95)
    grad_clip: StrictFloat = Field(1.0, ge=0, description="0 disables clipping")
    grad_accum: StrictInt = Field(1, ge=1)
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Autocast compute dtype; auto: bfloat16 on GPUs that support it, else float32"
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="Recompute in backward: full, each transformer block; selective, per operator, keeping "
        "attention's and every other matmul's outputs (torchtitan's policy). true / false read as full / none",
    )
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

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing_from_bool(cls, value: object) -> object:
        """The field was a bool: recipes and `--set` overrides that still give one keep their meaning."""
        if isinstance(value, bool):
            return "full" if value else "none"
        return value

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
    batch_size: StrictInt = Field(8, ge=1, description="Held-out prompts decoded together (one KV cache)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where evaluation runs; auto: the GPU where there is one, else the CPU"
    )


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
