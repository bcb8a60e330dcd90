"""The cluster as the scheduler sees it: node groups of one GPU type each, free GPUs per node, placement.

Jobs get power-of-two GPU counts and every group has a power-of-two number of GPUs per node (true of the
clusters we model), so a job either fits inside one node or takes whole nodes. Best-fit inside a node and
whole free nodes across nodes pack a job onto as few nodes as possible; with power-of-two sizes, repacking
a group largest-first always succeeds when its free total suffices, which is how fragmentation is undone
(by migrating the jobs that move).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from omni_core.recipe.schedule_sections import ClusterConfig


@dataclass(frozen=True)
class GroupSpec:
    gpu_type: str
    nodes: int
    gpus_per_node: int
    interconnect: str = ""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


Placement = tuple[int, ...]  # node indices inside the job's group, one entry per GPU taken on that node


def find_nodes(free: np.ndarray, per_node: int, n: int) -> Placement | None:
    """Nodes for n GPUs given free GPUs per node: the fullest node that fits (keeping emptier nodes whole
    for big jobs), or ceil(n / per_node) whole free nodes."""
    if n <= per_node:
        fits = np.flatnonzero(free >= n)
        return (int(fits[np.argmin(free[fits])]),) * n if fits.size else None
    whole = np.flatnonzero(free == per_node)
    need = -(-n // per_node)
    return tuple(int(i) for i in whole[:need] for _ in range(per_node)) if whole.size >= need else None


@dataclass
class Cluster:
    groups: dict[str, GroupSpec]
    free: dict[str, np.ndarray] = field(init=False)  # free GPUs per node, per GPU type
    placements: dict[str, tuple[str, Placement]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        for g in self.groups.values():
            if g.gpus_per_node & (g.gpus_per_node - 1):
                raise ValueError(f"{g.gpu_type}: gpus_per_node={g.gpus_per_node} must be a power of two")
        self.free = {t: np.full(g.nodes, g.gpus_per_node, dtype=np.int64) for t, g in self.groups.items()}

    @classmethod
    def from_config(cls, cfg: ClusterConfig) -> Cluster:
        groups: dict[str, GroupSpec] = {}
        for ng in cfg.node_groups:
            if ng.gpu_type in groups:
                raise ValueError(f"cluster {cfg.name!r}: GPU type {ng.gpu_type!r} listed twice")
            groups[ng.gpu_type] = GroupSpec(ng.gpu_type, ng.nodes, ng.gpus_per_node, ng.interconnect)
        if not groups:
            raise ValueError(f"cluster {cfg.name!r} has no node groups")
        return cls(groups)

    # --- state -------------------------------------------------------------------------------------------

    @property
    def total_gpus(self) -> int:
        return sum(g.gpus for g in self.groups.values())

    def capacity(self) -> dict[str, int]:
        return {t: g.gpus for t, g in self.groups.items()}

    def fragmentation(self) -> float:
        """Share of free GPUs stranded on partly used nodes (they cannot host a whole-node job)."""
        free = stranded = 0
        for t, f in self.free.items():
            free += int(f.sum())
            stranded += int(f[f < self.groups[t].gpus_per_node].sum())
        return stranded / free if free else 0.0

    # --- placement ---------------------------------------------------------------------------------------

    def _find(self, gpu_type: str, n: int) -> Placement | None:
        return find_nodes(self.free[gpu_type], self.groups[gpu_type].gpus_per_node, n)

    def place(self, job_id: str, gpu_type: str, n: int) -> Placement | None:
        if job_id in self.placements:
            raise ValueError(f"job {job_id} is already placed")
        nodes = self._find(gpu_type, n)
        if nodes is not None:
            np.subtract.at(self.free[gpu_type], list(nodes), 1)
            self.placements[job_id] = (gpu_type, nodes)
        return nodes

    def release(self, job_id: str) -> None:
        gpu_type, nodes = self.placements.pop(job_id)
        np.add.at(self.free[gpu_type], list(nodes), 1)

    def apply(self, alloc: Mapping[str, tuple[str, int]], *, migrate: bool) -> tuple[set[str], set[str]]:
        """Make the placements match `alloc` (job -> (GPU type, count)). Unchanged jobs stay on their nodes;
        changed and new ones are placed largest first. A job that does not fit because the group is
        fragmented is placed by repacking the group when `migrate` is set, else left out.
        Returns (jobs that were moved to other nodes without a config change, jobs left out)."""
        for job_id in [j for j, (t, nodes) in self.placements.items() if alloc.get(j) != (t, len(nodes))]:
            self.release(job_id)
        pending = sorted((j for j in alloc if j not in self.placements), key=lambda j: (-alloc[j][1], j))
        left = {j for j in pending if self.place(j, *alloc[j]) is None}
        moved: set[str] = set()
        if migrate and left:
            for gpu_type in sorted({alloc[j][0] for j in left}):
                moved |= self._repack(gpu_type, alloc, left)
        return moved, left

    def _repack(self, gpu_type: str, alloc: Mapping[str, tuple[str, int]], left: set[str]) -> set[str]:
        """Place the group's jobs afresh, largest first; returns the jobs whose nodes changed."""
        before = {j: nodes for j, (t, nodes) in self.placements.items() if t == gpu_type}
        members = sorted([*before, *(j for j in left if alloc[j][0] == gpu_type)], key=lambda j: (-alloc[j][1], j))
        for j in before:
            self.release(j)
        for j in members:
            if self.place(j, gpu_type, alloc[j][1]) is not None:
                left.discard(j)
        left |= {j for j in before if j not in self.placements}  # only if alloc oversubscribed the group
        return {j for j, nodes in before.items() if self.placements.get(j, (None, nodes))[1] != nodes}

    def check(self) -> None:
        """Conservation: no node over- or under-booked, placements and free counts agree."""
        for t, g in self.groups.items():
            used = np.zeros(g.nodes, dtype=np.int64)
            for gpu_type, nodes in self.placements.values():
                if gpu_type == t:
                    np.add.at(used, list(nodes), 1)
            if np.any(used + self.free[t] != g.gpus_per_node) or np.any(self.free[t] < 0):
                raise AssertionError(f"{t}: GPUs double-booked or lost (used {used}, free {self.free[t]})")
