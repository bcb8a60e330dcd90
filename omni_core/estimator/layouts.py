"""Where an MLLM's encoders run, priced for MegaScale-Omni's comparison, each layout with its own best plan.

    omni           encoders on every rank, their own data-parallel layout over all ranks, work balanced
                   (grouped reordering), the longest items split over an LSSP group (searched), and their
                   forward/backward placed in the LLM pipeline's bubbles by the joint schedule
                   (`Efficiency.joint_pipeline` of the bubbles; `encoders.omni_encoder_seconds`)
    coupled        encoders on the first pipeline stage with the LLM's DP x TP, no rebalancing (Megatron-LLaVA)
    disaggregated  encoders on their own GPUs (DistTrain-style): the step is the slower of the encoder
                   GPUs and the LLM GPUs, plus shipping the embeddings across nodes; the split is searched
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from omni_core.common.catalog import GpuSpec
from omni_core.estimator.communication import collective_time
from omni_core.estimator.cost import Efficiency
from omni_core.estimator.encoders import encoder_seconds_per_sample, unbalanced_factor
from omni_core.estimator.search import best_for_gpus
from omni_core.estimator.workloads import Workload

LAYOUTS = ("omni", "coupled", "disaggregated")
ADAM_STATE_BYTES = 18.0  # bf16 weights + fp32 grads, master weights and two moments


@dataclass(frozen=True)
class LayoutResult:
    layout: str
    step_time_s: float | None  # None: no plan of this layout fits memory
    plan: str
    detail: str = ""


def disaggregated(workload: Workload, gpu: GpuSpec, num_gpus: int, gpus_per_node: int,
                  eff: Efficiency) -> LayoutResult:
    """Best split between encoder GPUs (pure data parallel, FSDP over them) and the LLM's, trying k/8 of
    the GPUs for the encoders (k = 1..7, whole nodes only)."""
    llm_only = replace(workload, encoder=(), encoder_cv=0.0, cache={})
    enc_params = sum(l.params for l in workload.encoder)
    full_act = sum(l.act_bytes for l in workload.encoder)  # one sample, every layer
    ckpt_act = sum(l.out_bytes for l in workload.encoder) + max(l.act_bytes for l in workload.encoder)
    out_bytes = workload.encoder[-1].out_bytes
    best: LayoutResult | None = None
    splits = sorted({num_gpus * k // 8 for k in range(1, 8) if (num_gpus * k // 8) % gpus_per_node == 0})
    for enc_gpus in [e for e in splits if 0 < e < num_gpus]:
        llm = best_for_gpus(llm_only, gpu, num_gpus - enc_gpus, gpus_per_node, eff=eff)
        if llm is None:
            continue
        per_gpu = workload.global_batch / enc_gpus
        states = enc_params * ADAM_STATE_BYTES / enc_gpus
        fitting = [passes for act, passes in ((full_act, 3), (ckpt_act, 4))  # checkpointing recomputes forward
                   if states + act * min(per_gpu, 1.0) * (1 + eff.workspace_frac) <= gpu.usable_bytes]
        if not fitting:
            continue
        encode = fitting[0] * encoder_seconds_per_sample(workload, gpu, eff) * per_gpu
        encode *= unbalanced_factor(workload.encoder_cv, max(per_gpu, 1.0), enc_gpus)
        encode += (1 - eff.dp_overlap) * collective_time("all_reduce", enc_params * eff.grad_bytes, enc_gpus,
                                                         gpu.inter_bw * eff.link, gpu.inter_lat)
        ship = 2 * workload.global_batch * out_bytes / (min(enc_gpus, num_gpus - enc_gpus) * gpu.inter_bw * eff.link)
        step = max(encode, llm.best.step_time_s) + ship
        if best is None or step < best.step_time_s:
            best = LayoutResult("disaggregated", step, f"enc{enc_gpus}+{llm.plan.name}",
                                f"encoder {encode:.2f}s on {enc_gpus} GPUs, LLM {llm.best.step_time_s:.2f}s")
    return best or LayoutResult("disaggregated", None, "", "no split fits memory")


def compare_layouts(workload: Workload, gpu: GpuSpec, num_gpus: int, gpus_per_node: int,
                    eff: Efficiency | None = None) -> dict[str, LayoutResult]:
    """Each layout's best step time on `num_gpus` GPUs (None where nothing fits)."""
    eff = eff or Efficiency()
    results = {}
    for layout in ("omni", "coupled"):
        cell = best_for_gpus(workload, gpu, num_gpus, gpus_per_node, eff=eff, layout=layout)
        lssp = cell.best.options.lssp if cell else 1
        results[layout] = LayoutResult(layout, cell.best.step_time_s if cell else None,
                                       (cell.plan.name + (f"+lssp{lssp}" if lssp > 1 else "")) if cell else "",
                                       "" if cell else "no plan fits memory")
    results["disaggregated"] = disaggregated(workload, gpu, num_gpus, gpus_per_node, eff)
    return results
