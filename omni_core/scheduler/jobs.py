"""Jobs the scheduler places, and the throughput table that the policies and the simulator read.

A job is a model name + global batch + iterations, an arrival time, an optional deadline and the GPU
type/count its user asked for (FCFS uses exactly that; the other policies choose for themselves).
`ThroughputTable` asks the oracle once per (model, batch, GPU type, GPU count) and keeps the answers as
numpy arrays over every configuration, so a policy's inner loop never calls the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from omni_core.estimator.oracle import PLAIN_DP, ReplicaPlan
from omni_core.recipe.schedule_sections import JobConfig

if TYPE_CHECKING:
    from omni_core.common.plan import ParallelPlan
    from omni_core.estimator.oracle import ThroughputOracle


@dataclass(frozen=True)
class Job:
    id: str
    model: str
    global_batch: int
    iterations: int
    arrival_s: float
    deadline_s: float | None = None
    gpu_type: str | None = None  # what the user asked for
    num_gpus: int | None = None

    @classmethod
    def from_config(cls, cfg: JobConfig) -> Job:
        return cls(
            cfg.name,
            cfg.model,
            cfg.global_batch,
            cfg.iterations,
            cfg.arrival_s,
            cfg.deadline_s,
            cfg.gpu_type,
            cfg.num_gpus,
        )

    @property
    def samples(self) -> int:
        return self.iterations * self.global_batch


Config = tuple[str, int]  # (GPU type, GPU count)


def power_of_two_counts(max_gpus: int) -> tuple[int, ...]:
    return tuple(1 << k for k in range(max_gpus.bit_length()) if 1 << k <= max_gpus)


class Replicas(NamedTuple):
    """A job as replicas of one model-parallel unit on every config (`ThroughputTable.replicated`)."""

    rates: np.ndarray  # samples/s; NaN where the plan cannot be formed or does not fit the estimator's memory rule
    mem_share: np.ndarray  # peak memory over the GPU's memory; NaN where the plan cannot be formed


class ThroughputTable:
    """Samples/s of every (model, batch) on every config, NaN = no fit: with the best plan (`rates`, what jobs
    run with) and as replicas of a fixed model-parallel unit (`replicated`, what the baselines decide with).

    `rates(job)[t, c]` is the throughput on `counts[c]` GPUs of `gpu_types[t]`; configs larger than a GPU
    type's capacity are NaN. Keys are (model, global_batch), so jobs of the same kind share one row set.
    """

    def __init__(self, oracle: ThroughputOracle, capacity: dict[str, int], max_gpus: int):
        self.oracle = oracle
        self.gpu_types = tuple(sorted(capacity))
        self.capacity = np.array([capacity[t] for t in self.gpu_types])
        self.counts = power_of_two_counts(max(1, min(max_gpus, int(self.capacity.max()))))
        self._rows: dict[tuple[str, int], np.ndarray] = {}
        self._replicas: dict[tuple[str, int, ReplicaPlan], Replicas] = {}

    def _configs(self) -> list[tuple[int, int, str, int]]:
        """(row, column, GPU type, count) of every config no larger than its type's capacity."""
        return [
            (t, c, gpu_type, n)
            for t, gpu_type in enumerate(self.gpu_types)
            for c, n in enumerate(self.counts)
            if n <= self.capacity[t]
        ]

    def rates(self, job: Job) -> np.ndarray:
        key = (job.model, job.global_batch)
        row = self._rows.get(key)
        if row is None:
            row = np.full((len(self.gpu_types), len(self.counts)), np.nan)
            for t, c, gpu_type, n in self._configs():
                value = self.oracle.throughput(job.model, job.global_batch, gpu_type, n)
                if value is not None and value > 0:
                    row[t, c] = value
            row.flags.writeable = False
            self._rows[key] = row
        return row

    def replicated(self, job: Job, plan: ReplicaPlan = PLAIN_DP) -> Replicas:
        """The job as `counts[c] / (tp x pp)` plain data-parallel replicas of `plan.unit` = (tp, pp) on every
        config (`ThroughputOracle.replicated`)."""
        key = (job.model, job.global_batch, plan)
        found = self._replicas.get(key)
        if found is None:
            rates, share = (np.full((len(self.gpu_types), len(self.counts)), np.nan) for _ in range(2))
            for t, c, gpu_type, n in self._configs():
                est = self.oracle.replicated(job.model, job.global_batch, gpu_type, n, plan)
                if est is not None:
                    share[t, c] = est.mem_share
                    rates[t, c] = est.samples_per_s if est.samples_per_s > 0 else np.nan
            rates.flags.writeable = share.flags.writeable = False
            found = self._replicas[key] = Replicas(rates, share)
        return found

    def rate(self, job: Job, config: Config) -> float:
        """Samples/s of `job` on `config`; NaN when it does not fit (or is not a modelled config)."""
        gpu_type, n = config
        if gpu_type not in self.gpu_types or n not in self.counts:
            return float("nan")
        return float(self.rates(job)[self.gpu_types.index(gpu_type), self.counts.index(n)])

    def modelled(self, job: Job) -> bool:
        """False when no config of the cluster runs the job (unknown model, or it fits nowhere)."""
        try:
            return bool(np.isfinite(self.rates(job)).any())
        except (KeyError, ValueError):  # the estimator does not know the model
            return False

    def plan(self, job: Job, config: Config) -> ParallelPlan | None:
        return self.oracle.best_plan(job.model, job.global_batch, *config)
