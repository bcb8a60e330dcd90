"""Throughput oracles with known answers, for the scheduler tests: what each policy should decide is worked
out by hand from them, where the estimator's own answers would need the estimator to be right first."""

from __future__ import annotations

import numpy as np

from omni_core.common.plan import ParallelPlan
from omni_core.estimator.oracle import PLAIN_DP, ReplicaEstimate

MEM = 10.0  # every hand-made GPU's memory; a replica's memory share is its peak over this


class TableOracle:
    """Known answers. `rates[(model, gpu_type, n)] = (best samples/s, replicated data-parallel samples/s or
    None)`; `units[(model, gpu_type, n, (tp, pp))] = samples/s or None` for replicas of larger units;
    `shares[(model, gpu_type, n)]`: a data-parallel replica's peak memory over the GPU's (default 0.5 where it
    fits, 2.0 where it does not)."""

    def __init__(
        self,
        rates: dict[tuple[str, str, int], tuple[float, float | None]],
        units: dict[tuple[str, str, int, tuple[int, int]], float | None] | None = None,
        shares: dict[tuple[str, str, int], float] | None = None,
    ):
        self.rates, self.units, self.shares = rates, units or {}, shares or {}

    def throughput(self, model, global_batch, gpu_type, num_gpus):
        return self.rates.get((model, gpu_type, num_gpus), (None, None))[0]

    def best_plan(self, model, global_batch, gpu_type, num_gpus):
        return ParallelPlan(dp_shard=num_gpus) if (model, gpu_type, num_gpus) in self.rates else None

    def replicated(self, model, global_batch, gpu_type, num_gpus, plan=PLAIN_DP):
        key, unit = (model, gpu_type, num_gpus), plan.unit
        if unit != (1, 1):
            if (*key, unit) not in self.units:
                return None
            rate = self.units[(*key, unit)]
            return ReplicaEstimate(rate or 0.0, MEM * (0.5 if rate else 2.0), MEM)
        if key not in self.rates:
            return None
        dp = self.rates[key][1]
        return ReplicaEstimate(dp or 0.0, MEM * self.shares.get(key, 0.5 if dp else 2.0), MEM)


def linear(model: str, speeds: dict[str, float], counts=(1, 2, 4, 8), eff: float = 1.0) -> dict:
    """Rates that scale by `eff` per doubling; data-parallel equals best."""
    return {(model, t, n): (s * n * eff ** np.log2(n),) * 2 for t, s in speeds.items() for n in counts}
