"""The sections the estimator and the scheduler read: the cluster and its node groups, the jobs, the
estimate stage's GPU types, the scheduling policy and trace replay, and the re-planning watcher."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, model_validator

from omni_core.recipe.base import Strict


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


# the scheduling policies (omni_core/scheduler/policies): `sia` is Sia as its paper defines it, `sia-artifact`
# Sia as the Crius artifact runs it
PolicyName = Literal["crius", "fcfs", "gavel", "sia", "sia-artifact"]


class ScheduleConfig(Strict):
    policy: PolicyName = "crius"
    round_s: StrictFloat = Field(
        300.0, gt=0, description="Seconds between decisions (Sia decides every minute inside: a multiple of 60)"
    )
    max_rounds: StrictInt = Field(2000, ge=1)
    policies: list[PolicyName] = Field(
        default_factory=list, description="Policies `omni simulate` compares side by side; empty: [policy]"
    )
    trace: str = Field("", description="Job trace CSV replayed by `omni simulate`; empty: the recipe's jobs")
    trace_format: Literal["auto", "crius", "itp", "philly"] = "auto"
    trace_gpu_types: dict[str, str] = Field(
        default_factory=dict,
        description="A trace's GPU type names -> the cluster's node-group types, where they differ (the Crius "
        "artifact's `a100` is a 40 GB part: {a100: a100-40gb}); unmapped names are the cluster's own",
    )
    trace_seed: StrictInt = Field(0, description="Seed of the mapping from raw trace rows to model jobs")
    trace_keep: StrictFloat = Field(1.0, gt=0, le=1, description="Seeded share of raw-trace jobs kept")
    trace_start_s: StrictFloat = Field(
        0.0, ge=0, description="Replay from this many seconds after the trace's first arrival"
    )
    restart_s: StrictFloat = Field(
        60.0,
        ge=0,
        description="Seconds a job loses restoring its checkpoint at each (re)start, under every policy whose "
        "source charges none of its own (`sia` pays its simulator's 30 s, `gavel` its simulator's 0 s; the "
        "Crius artifact charges 0: macro_def.py CKPT_RESUME_OVERHEAD)",
    )
    search_charge: Literal["new_config", "every_start"] = Field(
        "new_config",
        description="When a (re)start also pays its policy's plan search: the first time the job runs on a "
        "config (a found plan is kept), or at every (re)start, as the Crius artifact's simulator charges it "
        "(`sia`, whose paper resumes a preempted job with its plan, pays it once per config either way)",
    )
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
    max_gpus_per_job: StrictInt = Field(
        32,
        ge=1,
        description="Largest GPU count any policy may give a job (counts are powers of two up to it; the Crius "
        "artifact allows 16: macro_def.py SUPPORTED_GPU_NUM_LIST)",
    )
    segment_steps: StrictInt = Field(
        50,
        ge=1,
        description="`omni schedule`: steps a job trains per launch; each segment's end (a checkpoint) "
        "is where the scheduler may resize the job",
    )


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
