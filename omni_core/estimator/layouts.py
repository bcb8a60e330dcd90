"""Where an MLLM's encoders run, priced for MegaScale-Omni's comparison: each layout's best plan, searched as
plans of that layout (`ParallelPlan.encoders`, priced by `cost.estimate_step`; see `encoders` for each term).

    omni           encoders on every rank, balanced over the world, the longest items split over an LSSP group,
                   three phases around the LLM (what the runtime executes)
    coupled        encoders on the first pipeline stage with the LLM's DP x TP, no rebalancing (Megatron-LLaVA)
    disaggregated  encoders on ranks of their own (DistTrain-style): the step is the slower of the encoder ranks
                   and the LLM ranks, plus shipping the embeddings between them; the split is searched
                   among DistTrain's (`orchestration`: the GPUs a Megatron-LM layout of the LLM leaves)
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_core.common.catalog import GpuSpec
from omni_core.common.plan import EncoderLayout
from omni_core.estimator.cost import Efficiency
from omni_core.estimator.search import CellResult, best_for_gpus
from omni_core.estimator.workloads import Workload

LAYOUTS: tuple[EncoderLayout, ...] = ("omni", "coupled", "disaggregated")


@dataclass(frozen=True)
class LayoutResult:
    layout: str
    step_time_s: float | None  # None: no plan of this layout fits memory
    plan: str  # the best plan's name, its encoders' half included (`dp8-tp8+omni.v-fsdp`)
    detail: str = ""


def layout_result(layout: str, cell: CellResult | None) -> LayoutResult:
    """A layout's best Cell as a row of the comparison; a disaggregated plan says what each side takes."""
    if cell is None or cell.best is None:
        return LayoutResult(layout, None, "", "no plan fits memory")
    best = cell.best
    detail = ""
    if best.plan.encoders.layout == "disaggregated":
        detail = (
            f"encoder {best.breakdown['encoder_s']:.2f}s on {best.plan.encoders.ranks} GPUs, "
            f"LLM {best.breakdown['llm_s']:.2f}s"
        )
    return LayoutResult(layout, best.step_time_s, best.plan.name, detail)


def compare_layouts(
    workload: Workload, gpu: GpuSpec, num_gpus: int, gpus_per_node: int, eff: Efficiency | None = None
) -> dict[str, LayoutResult]:
    """Each layout's best step time on `num_gpus` GPUs over pipeline depths (None where nothing fits)."""
    eff = eff or Efficiency()
    return {
        layout: layout_result(layout, best_for_gpus(workload, gpu, num_gpus, gpus_per_node, eff=eff, layout=layout))
        for layout in LAYOUTS
    }
