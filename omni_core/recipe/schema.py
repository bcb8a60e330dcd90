"""Typed schema of a recipe: one YAML file describes a whole experiment pipeline.

Every section is strict (unknown keys are rejected) so that a typo fails at `omni recipe check`
instead of silently falling back to a default in the middle of a run; so is every number and switch
(`StrictInt`, `StrictFloat`, which still takes an int, `StrictBool`): `steps: true` or `steps: '30'` is an
error, not 1 step or 30. Sections that later stages (estimate, schedule, 5D parallelism) will consume are
typed here already; the runtime refuses values it cannot execute yet instead of ignoring them.

The sections are typed in modules of their own (`data_sections`, `model_sections`, `train_sections`,
`schedule_sections`, on the `base` they share); this module assembles them into the `Recipe` and hashes it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import Field, StrictInt, model_validator

from omni_core.recipe.base import Strict
from omni_core.recipe.data_sections import DataConfig
from omni_core.recipe.model_sections import ModelConfig, ParallelConfig
from omni_core.recipe.schedule_sections import (
    ClusterConfig,
    EstimateConfig,
    JobConfig,
    ReplanConfig,
    ScheduleConfig,
)
from omni_core.recipe.train_sections import EvalConfig, LaunchConfig, TrackingConfig, TrainConfig


class ExperimentConfig(Strict):
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="MLflow experiment name, run-name prefix and a path component: letters, digits, _ . -",
    )
    description: str = ""
    seed: StrictInt = Field(0, description="Seed for data generation, model init and data order")
    output_dir: str = Field("runs", description="Local root for generated data and checkpoints")


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

    @model_validator(mode="after")
    def _trace_types_in_cluster(self) -> Recipe:
        groups = {g.gpu_type for g in self.cluster.node_groups}
        unknown = sorted(t for t in self.schedule.trace_gpu_types.values() if groups and t not in groups)
        if unknown:
            raise ValueError(
                f"schedule.trace_gpu_types maps onto {unknown}, not a GPU type of cluster.node_groups {sorted(groups)}"
            )
        return self

    @model_validator(mode="after")
    def _tuned_parts_train(self) -> Recipe:
        tuned = {
            f"train.{field}.{part}"
            for field in ("lr_by_part", "weight_decay_by_part")
            for part in getattr(self.train, field)
            if part in self.model.freeze
        }
        if tuned:
            raise ValueError(f"{', '.join(sorted(tuned))}: the part is frozen (model.freeze), so it is never stepped")
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
            "model": self.model.model_dump(mode="json", exclude={"attention"}),  # how, not what, it computes
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
