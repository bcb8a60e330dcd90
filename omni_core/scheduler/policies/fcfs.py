"""First come, first served: the user's GPU type and count in arrival order; never preempts or moves a job.
The simplest baseline for Crius."""

from __future__ import annotations

import numpy as np

from omni_core.scheduler.cluster import find_nodes
from omni_core.scheduler.jobs import Config, Job, ThroughputTable
from omni_core.scheduler.policies.base import Policy, View, requested_count


class Fcfs(Policy):
    """The user's GPU type and count in arrival order, no preemption; its jobs run the best plan too, so they
    pay the unpruned plan search at their start."""

    name = "fcfs"
    migrates = False

    def admits(self, job: Job, table: ThroughputTable) -> bool:
        return _request(job, table) is not None

    def decide(self, view: View) -> dict[str, Config]:
        alloc = dict(view.current)
        free = {t: view.cluster.free[t].copy() for t in view.table.gpu_types}
        for job in view.jobs:
            request = None if job.id in alloc else _request(job, view.table)
            if request is None:
                continue  # running, or a request that cannot run this model (it never starts)
            gpu_type, n = request
            nodes = find_nodes(free[gpu_type], view.cluster.groups[gpu_type].gpus_per_node, n)
            if nodes is not None:
                np.subtract.at(free[gpu_type], list(nodes), 1)
                alloc[job.id] = request
        return alloc


def _request(job: Job, table: ThroughputTable) -> Config | None:
    """The user's GPU type and count (rounded up to a power of two), where they run the model; else None."""
    if job.gpu_type not in table.gpu_types:
        return None
    rates = table.rates(job)
    c = requested_count(job, table, rates)
    if c is None or not np.isfinite(rates[table.gpu_types.index(job.gpu_type), c]):
        return None
    return job.gpu_type, table.counts[c]
