"""Jobs the scheduler places, and the throughput table that the policies and the simulator read.

A job is a model name + global batch + iterations, an arrival time, an optional deadline and the GPU
type/count its user asked for (FCFS uses exactly that; the other policies choose for themselves).
`ThroughputTable` asks the oracle once per (model, batch, GPU type, GPU count) and keeps the answers as
numpy arrays over every configuration, so a policy's inner loop never calls the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

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


class ThroughputTable:
    """Samples/s of every (model, batch) on every config, best plan and data-parallel only, NaN = no fit.

    `best[key][t, c]` is the throughput on `counts[c]` GPUs of `gpu_types[t]`; configs larger than a GPU
    type's capacity are NaN. Keys are (model, global_batch), so jobs of the same kind share one row set.
    """

    def __init__(self, oracle: ThroughputOracle, capacity: dict[str, int], max_gpus: int):
        self.oracle = oracle
        self.gpu_types = tuple(sorted(capacity))
        self.capacity = np.array([capacity[t] for t in self.gpu_types])
        self.counts = power_of_two_counts(max(1, min(max_gpus, int(self.capacity.max()))))
        self._rows: dict[tuple[str, int, bool], np.ndarray] = {}
        self._normalised: dict[tuple[str, int, bool], np.ndarray] = {}

    def rates(self, job: Job, *, dp_only: bool = False) -> np.ndarray:
        key = (job.model, job.global_batch, dp_only)
        row = self._rows.get(key)
        if row is None:
            row = np.full((len(self.gpu_types), len(self.counts)), np.nan)
            for t, gpu_type in enumerate(self.gpu_types):
                for c, n in enumerate(self.counts):
                    if n <= self.capacity[t]:
                        value = self.oracle.throughput(job.model, job.global_batch, gpu_type, n, dp_only=dp_only)
                        if value is not None and value > 0:
                            row[t, c] = value
            row.flags.writeable = False
            self._rows[key] = row
        return row

    def normalised(self, job: Job, *, dp_only: bool = False) -> np.ndarray:
        """Throughput in "effective GPUs": divided by the job's best samples/s per GPU over all configs, so
        that one GPU's worth of any job weighs the same when policies add jobs up."""
        key = (job.model, job.global_batch, dp_only)
        row = self._normalised.get(key)
        if row is None:
            rates = self.rates(job, dp_only=dp_only)
            row = rates / np.nanmax(rates / np.asarray(self.counts)) if np.isfinite(rates).any() else rates
            row.flags.writeable = False
            self._normalised[key] = row
        return row

    def rate(self, job: Job, config: Config, *, dp_only: bool = False) -> float:
        """Samples/s of `job` on `config`; NaN when it does not fit (or is not a modelled config)."""
        gpu_type, n = config
        if gpu_type not in self.gpu_types or n not in self.counts:
            return float("nan")
        return float(self.rates(job, dp_only=dp_only)[self.gpu_types.index(gpu_type), self.counts.index(n)])

    def modelled(self, job: Job) -> bool:
        """False when no config of the cluster runs the job (unknown model, or it fits nowhere)."""
        try:
            return bool(np.isfinite(self.rates(job)).any())
        except (KeyError, ValueError):  # the estimator does not know the model
            return False

    def plan(self, job: Job, config: Config) -> ParallelPlan | None:
        return self.oracle.best_plan(job.model, job.global_batch, *config)
