"""A simulation study from a recipe: its cluster, its jobs (or a trace), one or more policies side by side.

The throughput oracle is the estimator's `CellOracle` unless a caller passes another (tests pass small
hand-made ones). Every policy replays the same jobs on a fresh copy of the cluster and shares one
`ThroughputTable`, so the oracle is asked once per (model, batch, config) for the whole study.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omni_core.recipe import Recipe
from omni_core.scheduler.cluster import Cluster
from omni_core.scheduler.jobs import Job, ThroughputTable
from omni_core.scheduler.policies import make_policy
from omni_core.scheduler.simulator import SchedulePlan, simulate
from omni_core.scheduler.traces import Trace, load_trace

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
            self.jobs, Cluster.from_config(self.recipe.cluster), make_policy(policy), self.table, round_s=s.round_s,
            rounds=rounds or s.max_rounds, restart_s=s.restart_s, trace=self.source,
            issues=[str(i) for i in self.trace.issues] if self.trace else (),
        )


def default_oracle(cluster: Cluster) -> ThroughputOracle:
    from omni_core.common.catalog import GpuCatalog
    from omni_core.estimator.oracle import CellOracle

    return CellOracle(GpuCatalog(), {t: g.gpus_per_node for t, g in cluster.groups.items()})


def prepare(recipe: Recipe, *, trace: str | None = None, oracle: ThroughputOracle | None = None) -> Study:
    """Read the recipe's trace (or `trace`), map it to jobs if it is raw, and build the throughput table."""
    s = recipe.schedule
    cluster = Cluster.from_config(recipe.cluster)
    table = ThroughputTable(oracle or default_oracle(cluster), cluster.capacity(), s.max_gpus_per_job)
    path = trace if trace is not None else s.trace
    if not path:
        return Study(recipe, table, [Job.from_config(j) for j in recipe.jobs], None)
    loaded = load_trace(path, table, fmt=s.trace_format, seed=s.trace_seed, keep=s.trace_keep,
                        max_gpus=s.max_gpus_per_job, start_s=s.trace_start_s)
    return Study(recipe, table, loaded.jobs, loaded)


def compare(study: Study, policies: Sequence[str], rounds: int | None = None) -> dict[str, SchedulePlan]:
    return {p: study.run(p, rounds) for p in policies}
