"""First come, first served: the user's GPU type and count in arrival order; never preempts or moves a job.
The simplest baseline for Crius."""

from __future__ import annotations

import numpy as np

from omni_core.scheduler.cluster import find_nodes
from omni_core.scheduler.jobs import Config
from omni_core.scheduler.policies.base import Policy, View, requested_count


class Fcfs(Policy):
    """The user's GPU type and count in arrival order, no preemption; its jobs run the best plan too, so they
    pay the unpruned plan search at their start."""

    name = "fcfs"
    migrates = False

    def decide(self, view: View) -> dict[str, Config]:
        alloc = dict(view.current)
        free = {t: view.cluster.free[t].copy() for t in view.table.gpu_types}
        for job in view.jobs:
            if job.id in alloc or job.gpu_type not in free:
                continue
            rates = view.table.rates(job)
            c = requested_count(job, view.table, rates)
            if c is None or not np.isfinite(rates[view.table.gpu_types.index(job.gpu_type), c]):
                continue  # the user's request cannot run this model: it waits (reported unfinished)
            nodes = find_nodes(
                free[job.gpu_type], view.cluster.groups[job.gpu_type].gpus_per_node, view.table.counts[c]
            )
            if nodes is not None:
                np.subtract.at(free[job.gpu_type], list(nodes), 1)
                alloc[job.id] = (job.gpu_type, view.table.counts[c])
        return alloc
