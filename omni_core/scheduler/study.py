"""A simulation study from a recipe: its cluster, its jobs (or a trace), one or more policies side by side.

The throughput oracle is the estimator's `CellOracle` unless a caller passes another (tests pass small
hand-made ones). Every policy replays the same jobs on a fresh copy of the cluster and shares one
`ThroughputTable`, so the oracle is asked once per (model, batch, config) for the whole study.

A relative `schedule.trace` resolves against the folder of the recipe file that wrote it (`load_study`), so
a study and its trace copied elsewhere together still run from any working directory; a path given on the
command line (`--trace`, `--set`) resolves against the working directory, as the user typed it. The study's
conventions (`schedule.iteration_scale`, `arrival_compression`, `fixed_horizon`, `busy_min_throughput`,
`max_gpus_per_job`, `restart_s`, `search_charge`, `trace_gpu_types`) are applied here, in the policies and in the
simulator, so a study matches the Crius artifact's by setting them.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from omni_core.recipe import Recipe, RecipeError, load_located, override_recipe
from omni_core.recipe.loader import OVERRIDE_LABEL, located_problem
from omni_core.scheduler.cluster import Cluster
from omni_core.scheduler.jobs import Job, ThroughputTable
from omni_core.scheduler.policies import make_policy
from omni_core.scheduler.simulator import SchedulePlan, simulate
from omni_core.scheduler.traces import HEADERS, Trace, detect_format, load_trace

if TYPE_CHECKING:
    from omni_core.estimator.oracle import ThroughputOracle


@dataclass
class Study:
    recipe: Recipe
    table: ThroughputTable
    jobs: list[Job]
    trace: Trace | None

    @property
    def source(self) -> str:
        return self.trace.path if self.trace is not None else "recipe jobs"

    def run(self, policy: str, rounds: int | None = None) -> SchedulePlan:
        s = self.recipe.schedule
        return simulate(
            self.jobs,
            Cluster.from_config(self.recipe.cluster),
            make_policy(policy, search_every_start=s.search_charge == "every_start"),
            self.table,
            round_s=s.round_s,
            rounds=rounds or s.max_rounds,
            restart_s=s.restart_s,
            trace=self.source,
            issues=[str(i) for i in self.trace.issues] if self.trace else (),
            fixed_horizon=s.fixed_horizon,
            busy_min_throughput=s.busy_min_throughput,
        )


def default_oracle(cluster: Cluster) -> ThroughputOracle:
    from omni_core.common.catalog import GpuCatalog
    from omni_core.estimator.oracle import CellOracle

    return CellOracle(GpuCatalog(), {t: g.gpus_per_node for t, g in cluster.groups.items()})


def scale_jobs(jobs: Sequence[Job], *, iteration_scale: float = 1.0, arrival_compression: float = 1.0) -> list[Job]:
    """Jobs with iterations divided by `iteration_scale` (at least one) and arrival times and deadlines
    divided by `arrival_compression`: the Crius artifact's shorter jobs, or a more contended trace."""

    def scaled(job: Job) -> Job:
        deadline = None if job.deadline_s is None else job.deadline_s / arrival_compression
        return replace(
            job,
            iterations=max(1, round(job.iterations / iteration_scale)),
            arrival_s=job.arrival_s / arrival_compression,
            deadline_s=deadline,
        )

    return [scaled(job) for job in jobs]


def replicate(jobs: Sequence[Job], copies: int) -> list[Job]:
    """`copies` copies of every job (ids suffixed `#k`, same arrivals): the load of a cluster `copies` times
    larger, for the scale study."""
    return [replace(job, id=f"{job.id}#{k}") if k else job for k in range(copies) for job in jobs]


def scaled(study: Study, factor: int) -> Study:
    """The study on a cluster with `factor` times the nodes of every group and `factor` copies of its jobs:
    the same load per GPU, so what grows is only the size of each decision (the scale study)."""
    groups = study.recipe.cluster.node_groups
    recipe = override_recipe(
        study.recipe,
        [
            o
            for i, g in enumerate(groups)
            for o in (f"cluster.node_groups.{i}.nodes={g.nodes * factor}", f"cluster.node_groups.{i}.hosts=[]")
        ],
    )
    cluster = Cluster.from_config(recipe.cluster)
    table = ThroughputTable(study.table.oracle, cluster.capacity(), recipe.schedule.max_gpus_per_job)
    return Study(recipe, table, replicate(study.jobs, factor), study.trace)


def prepare(recipe: Recipe, *, trace: str | None = None, oracle: ThroughputOracle | None = None) -> Study:
    """Read the recipe's trace (or `trace`), map it to jobs if it is raw, apply the study's scaling, and
    build the throughput table. Relative paths resolve against the working directory (`load_study`
    resolves the recipe's own against its file)."""
    s = recipe.schedule
    cluster = Cluster.from_config(recipe.cluster)
    table = ThroughputTable(oracle or default_oracle(cluster), cluster.capacity(), s.max_gpus_per_job)
    path = trace if trace is not None else s.trace
    loaded = None
    jobs = [Job.from_config(j) for j in recipe.jobs]
    if path:
        loaded = load_trace(
            path,
            table,
            fmt=s.trace_format,
            seed=s.trace_seed,
            keep=s.trace_keep,
            max_gpus=s.max_gpus_per_job,
            start_s=s.trace_start_s,
            gpu_type_names=s.trace_gpu_types,
        )
        jobs = loaded.jobs
    jobs = scale_jobs(jobs, iteration_scale=s.iteration_scale, arrival_compression=s.arrival_compression)
    return Study(recipe, table, jobs, loaded)


def load_study(
    path: str | Path, overrides: Sequence[str] = (), *, trace: str | None = None, oracle: ThroughputOracle | None = None
) -> Study:
    """Load the recipe at `path` and prepare its study, a relative `schedule.trace` taken from the folder of
    the file that wrote it (an `extends:` parent's folder when the parent wrote it)."""
    recipe, locations = load_located(path, overrides)
    return prepare(recipe, trace=checked_trace(recipe, locations) if trace is None else trace, oracle=oracle)


def checked_trace(recipe: Recipe, locations: dict[str, str]) -> str:
    """The recipe's `schedule.trace` resolved (`trace_path`), refused at the line that wrote it when the file is
    missing or its header lacks its `schedule.trace_format`'s columns (a format detected only from an exact
    header); rows are checked, and counted, when read."""
    s = recipe.schedule
    trace = trace_path(s.trace, locations.get("schedule.trace"))
    if not trace:
        return trace
    if not os.path.isfile(trace):
        raise RecipeError([located_problem(locations, "schedule.trace", f"no such file: {trace}")])
    try:
        with open(trace, newline="") as f:
            header = next(csv.reader(f), [])
        if s.trace_format == "auto":
            detect_format(trace)
    except (ValueError, OSError, UnicodeDecodeError) as err:
        raise RecipeError([located_problem(locations, "schedule.trace", str(err))]) from None
    expected = () if s.trace_format == "auto" else HEADERS[s.trace_format]  # auto: detect_format checked it
    missing = [c for c in expected if c not in header]
    if missing:
        raise RecipeError(
            [
                located_problem(
                    locations,
                    "schedule.trace_format",
                    f"{s.trace_format}: {trace}:1 lacks the column(s) {', '.join(missing)}",
                )
            ]
        )
    return trace


def trace_path(trace: str, written_at: str | None) -> str:
    """`trace` as the recipe meant it: relative to the folder of the file at `written_at` ("FILE:LINE");
    unchanged when absolute, empty, or not written in a file (an override, a default)."""
    if not trace or os.path.isabs(trace) or written_at is None or written_at.startswith(OVERRIDE_LABEL):
        return trace
    return os.path.normpath(Path(written_at.rsplit(":", 1)[0]).parent / trace)


def compare(study: Study, policies: Sequence[str], rounds: int | None = None) -> dict[str, SchedulePlan]:
    return {p: study.run(p, rounds) for p in policies}
