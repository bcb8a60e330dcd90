"""The throughput oracle the scheduler asks: samples/s of a job on a Cell (GPU type x GPU count).

`ThroughputOracle` is the protocol the scheduler codes against; `CellOracle` answers it from the estimator
for trace model names (`bert__1.3B`, `moe__10B`, `wide_resnet__2B`, see
`omni_core.estimator.trace_workloads.trace_workload`), or for whatever names its `workload` function knows
(real mode: model flavors at the recipe's sequence length).
The scheduler calls it thousands of times per simulated round, so answers are memoised per
(model, batch, GPU type, GPU count): the first call searches the Cell's plans, later calls are a dict look-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from omni_core.common.catalog import GpuCatalog
    from omni_core.common.plan import ParallelPlan
    from omni_core.estimator.search import CellResult
    from omni_core.estimator.workloads import Workload


@runtime_checkable
class ThroughputOracle(Protocol):
    def throughput(
        self, model: str, global_batch: int, gpu_type: str, num_gpus: int, *, dp_only: bool = False
    ) -> float | None:
        """Samples/s with the best plan on `num_gpus` GPUs of `gpu_type` (the best pure data-parallel plan
        when `dp_only`); None when no plan fits memory."""
        ...

    def best_plan(self, model: str, global_batch: int, gpu_type: str, num_gpus: int) -> ParallelPlan | None:
        """The plan behind `throughput(...)`, or None when no plan fits memory."""
        ...


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
        self._cells: dict[tuple[str, int, str, int, bool], CellResult | None] = {}

    def cell(self, model: str, global_batch: int, gpu_type: str, num_gpus: int, *, dp_only: bool = False):
        """The memoised `CellResult` (best plan, step time, memory) or None when nothing fits."""
        key = (model, global_batch, gpu_type, num_gpus, dp_only)
        try:
            return self._cells[key]
        except KeyError:
            pass
        from omni_core.estimator.search import best_for_gpus
        from omni_core.estimator.trace_workloads import trace_workload

        gpu = self.catalog[gpu_type]
        per_node = self.gpus_per_node.get(gpu_type, gpu.gpus_per_node)
        workload = (self.workload or trace_workload)(model, global_batch)
        result = best_for_gpus(workload, gpu, num_gpus, per_node, dp_only=dp_only)
        self._cells[key] = result
        return result

    def remember(self, model: str, global_batch: int, cell: CellResult) -> None:
        """Answer for `cell`'s GPU type and count from an estimate already made (the estimate stage's CellTable)."""
        self._cells[(model, global_batch, cell.gpu_type, cell.num_gpus, False)] = cell

    def throughput(
        self, model: str, global_batch: int, gpu_type: str, num_gpus: int, *, dp_only: bool = False
    ) -> float | None:
        result = self.cell(model, global_batch, gpu_type, num_gpus, dp_only=dp_only)
        return None if result is None else result.samples_per_s

    def best_plan(self, model: str, global_batch: int, gpu_type: str, num_gpus: int) -> ParallelPlan | None:
        result = self.cell(model, global_batch, gpu_type, num_gpus)
        return None if result is None else result.plan
