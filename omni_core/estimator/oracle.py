"""The throughput oracle the scheduler asks: samples/s of a job on a Cell (GPU type x GPU count).

`ThroughputOracle` is the protocol the scheduler codes against; `CellOracle` answers it from the estimator
for trace model names (`bert__1.3B`, `moe__10B`, `wide_resnet__2B`, see
`omni_core.estimator.trace_workloads.trace_workload`), or for whatever names its `workload` function knows
(real mode: model flavors at the recipe's sequence length).
The scheduler calls it thousands of times per simulated round, so answers are memoised per
(model, batch, GPU type, GPU count): the first call searches the Cell's plans, later calls are a dict look-up.
`replicated` prices one fixed kind of plan instead of searching: data-parallel replicas of a model-parallel
unit, the plans the scheduler's baselines decide with (they do not search plans as Crius does).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    from omni_core.common.catalog import GpuCatalog
    from omni_core.common.plan import ParallelPlan
    from omni_core.estimator.search import CellResult
    from omni_core.estimator.workloads import Workload


class ReplicaPlan(NamedTuple):
    """Which fixed plan `ThroughputOracle.replicated` prices: replicas of a (tp, pp) `unit`, whether a
    replica may split its local batch into micro-batches (gradient accumulation: the fastest that fit, or
    `micro_batches` of them where the job fixes that many), and whether the replicas shard the fp32 master copy
    and the optimizer states among themselves, each stepping its slice, weights and gradients whole (ZeRO-1, as
    Alpa's data parallelism runs with prefer_reduce_scatter); else all replicated."""

    unit: tuple[int, int] = (1, 1)
    micro_batching: bool = False
    sharded_states: bool = False
    micro_batches: int = 0  # with `micro_batching`: the job's own count (of at least one sample); 0: searched


PLAIN_DP = ReplicaPlan()  # one GPU per replica, the whole local batch at once: plain data parallelism


@runtime_checkable
class ThroughputOracle(Protocol):
    def throughput(self, model: str, global_batch: int, gpu_type: str, num_gpus: int) -> float | None:
        """Samples/s with the best plan on `num_gpus` GPUs of `gpu_type`; None when no plan fits memory."""
        ...

    def best_plan(self, model: str, global_batch: int, gpu_type: str, num_gpus: int) -> ParallelPlan | None:
        """The plan behind `throughput(...)`, or None when no plan fits memory."""
        ...

    def replicated(
        self, model: str, global_batch: int, gpu_type: str, num_gpus: int, plan: ReplicaPlan = PLAIN_DP
    ) -> ReplicaEstimate | None:
        """`num_gpus / (tp x pp)` replicas of the `plan.unit` = (tp, pp) model-parallel unit, the replicas plain
        data parallel (weights, gradients and optimizer states replicated; with `plan.sharded_states` the master
        copy and optimizer states sharded over them, the rest replicated), recomputation only
        where the job fixes it; each replica's local batch in one micro-batch, or with `plan.micro_batching` in
        the fastest micro-batches that fit (gradient accumulation). None when the plan cannot be formed."""
        ...


@dataclass(frozen=True)
class ReplicaEstimate:
    """What `ThroughputOracle.replicated` answers: throughput and memory of one fixed plan."""

    samples_per_s: float  # 0.0 when it does not fit the GPU's memory (the estimator's own rule)
    peak_mem_bytes: float  # the fitting plan's, else the least any micro-batch needed
    mem_bytes: float  # the GPU's memory (`GpuSpec.mem_gb`), for a policy's own memory rule

    @property
    def mem_share(self) -> float:
        return self.peak_mem_bytes / self.mem_bytes


class CellOracle:
    """`ThroughputOracle` over the estimator's Cell search, memoised.

    `gpus_per_node[gpu_type]` is the node size of that GPU type in the cluster (a Cell of n GPUs spans
    ceil(n / gpus_per_node) nodes); types missing from it take the catalogue's node size. `workload` turns
    a (model, global batch) into the estimator's Workload; the default reads trace model names.
    """

    def __init__(
        self, catalog: GpuCatalog, gpus_per_node: dict[str, int], workload: Callable[[str, int], Workload] | None = None
    ):
        self.catalog = catalog
        self.gpus_per_node = dict(gpus_per_node)
        self.workload = workload
        self._cells: dict[tuple[str, int, str, int], CellResult | None] = {}
        self._replicas: dict[tuple[str, int, str, int, ReplicaPlan], ReplicaEstimate | None] = {}

    def cell(self, model: str, global_batch: int, gpu_type: str, num_gpus: int):
        """The memoised `CellResult` (best plan, step time, memory) or None when nothing fits."""
        key = (model, global_batch, gpu_type, num_gpus)
        try:
            return self._cells[key]
        except KeyError:
            pass
        from omni_core.estimator.search import best_for_gpus

        gpu = self.catalog[gpu_type]
        per_node = self.gpus_per_node.get(gpu_type, gpu.gpus_per_node)
        result = best_for_gpus(self._workload(model, global_batch), gpu, num_gpus, per_node)
        self._cells[key] = result
        return result

    def remember(self, model: str, global_batch: int, cell: CellResult) -> None:
        """Answer for `cell`'s GPU type and count from an estimate already made (the estimate stage's CellTable)."""
        self._cells[(model, global_batch, cell.gpu_type, cell.num_gpus)] = cell

    def throughput(self, model: str, global_batch: int, gpu_type: str, num_gpus: int) -> float | None:
        result = self.cell(model, global_batch, gpu_type, num_gpus)
        return None if result is None else result.samples_per_s

    def best_plan(self, model: str, global_batch: int, gpu_type: str, num_gpus: int) -> ParallelPlan | None:
        result = self.cell(model, global_batch, gpu_type, num_gpus)
        return None if result is None else result.plan

    def replicated(
        self, model: str, global_batch: int, gpu_type: str, num_gpus: int, plan: ReplicaPlan = PLAIN_DP
    ) -> ReplicaEstimate | None:
        key = (model, global_batch, gpu_type, num_gpus, plan)
        if key not in self._replicas:
            self._replicas[key] = self._replica_estimate(model, global_batch, gpu_type, num_gpus, plan)
        return self._replicas[key]

    def _replica_estimate(
        self, model: str, global_batch: int, gpu_type: str, num_gpus: int, replica: ReplicaPlan
    ) -> ReplicaEstimate | None:
        from omni_core.common.catalog import GB
        from omni_core.common.plan import ParallelPlan, PlanError
        from omni_core.estimator.calibration import calibrated
        from omni_core.estimator.cost import Options, estimate_step
        from omni_core.estimator.search import powers_of_two

        tp, pp = replica.unit
        replicas, rest = divmod(num_gpus, tp * pp)
        gpu, eff = calibrated(self.catalog[gpu_type])
        per_node = self.gpus_per_node.get(gpu_type, gpu.gpus_per_node)
        if rest or tp > per_node or global_batch % max(replicas, 1) or not replicas:
            return None
        workload = self._workload(model, global_batch)
        if replica.sharded_states:
            eff = replace(eff, zero_master_sharded=True)
        try:
            if replica.sharded_states:
                plan = ParallelPlan(dp_shard=replicas, sharding="zero1", tp=tp, pp=pp)
            else:
                plan = ParallelPlan(dp_replicate=replicas, tp=tp, pp=pp)
            plan.check_model(workload.shape)
        except PlanError:
            return None
        local = global_batch // replicas
        if not replica.micro_batching:
            sizes = [local]
        elif replica.micro_batches:  # the job's own count
            sizes = [max(1, local // replica.micro_batches)]
        else:
            sizes = [mb for mb in powers_of_two(local) if local % mb == 0]
        checkpoint = bool(workload.recompute)
        tried = [
            estimate_step(workload, gpu, plan, Options(mb, checkpoint), gpus_per_node=per_node, eff=eff) for mb in sizes
        ]
        fitting = [e for e in tried if e.fits]
        mem = gpu.mem_gb * GB
        if fitting:
            best = min(fitting, key=lambda e: e.step_time_s)
            return ReplicaEstimate(best.samples_per_s, best.peak_mem_bytes, mem)
        return ReplicaEstimate(0.0, min((e.peak_mem_bytes for e in tried), default=math.inf), mem)

    def _workload(self, model: str, global_batch: int) -> Workload:
        from omni_core.estimator.trace_workloads import trace_workload

        return (self.workload or trace_workload)(model, global_batch)
