"""How a step's work spread over the ranks: encoder and LLM seconds, the loader's predicted imbalance, the
pipeline's bubble and the encoder handoff's bytes. Each rank's values travel in the step's one all-reduce
(`runtime.step.train_step`), then become the metrics that compare encoder layouts and balancing policies."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from omni_core.common.batch import PackedBatch
from omni_core.runtime.dist import on_device
from omni_core.runtime.replica import ModelReplica

LAYOUT_VALUES = 8
PEAKED = 6  # of the layout values, those also maxed over the world


def layout_values(
    replica: ModelReplica, batches: list[PackedBatch], llm_s: float, device: torch.device
) -> torch.Tensor:
    """This rank's [encoder seconds, LLM seconds, predicted encoder, LLM and total FLOPs, balancing seconds,
    pipeline bubble share, handoff bytes], float64 on the step's device: summed over the world with the loss
    statistics (one all-reduce), the first six also maxed (`layout_metrics`). The pipeline's bubble is the
    idle share of the rank's span of encoder and LLM work: 1 - (stage compute + encoder compute) / (LLM phase +
    the encoders' time outside it), the same measure for every layout and encoder schedule (a coupled step's
    encoders run inside stage 0's compute; a joint schedule's run inside the LLM phase's waits). The
    predictions are the loader's cost model on this rank's batches (`data.balance`)."""
    encoder = replica.encoders.metrics if replica.encoders else {}
    bubble = 0.0
    if replica.pipeline is not None and llm_s > 0:
        busy = replica.pipeline.busy_s + encoder.get("encoder_s", 0.0)
        bubble = max(0.0, 1.0 - busy / (llm_s + encoder.get("outside_s", 0.0)))
    predicted = [sum(b.predicted_flops[k] for b in batches) for k in (0, 1)]
    return on_device(
        [
            encoder.get("encoder_s", 0.0),
            llm_s,
            *predicted,
            sum(predicted),
            sum(b.balance_s for b in batches),
            bubble,
            encoder.get("handoff_bytes", 0.0),
        ],
        device,
    )


def layout_metrics(replica: ModelReplica, summed: Sequence[float], peaks: Sequence[float]) -> dict[str, float]:
    """Encoder and LLM seconds per rank as max and mean over the world, the predicted imbalance (max / mean
    over the LLM's ranks, which all hold their shard's batches) of the encoders' and the LLM's work, the
    slowest rank's balancing seconds, the bubble's mean over the LLM's ranks, the handoff's bytes and LSSP's
    items (`omni`, `disaggregated`). `summed`: the layout values summed over the world; `peaks`: the first
    PEAKED of them maxed over it (host numbers, read with the step's other metrics)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    llm_ranks = replica.plan.llm_world_size

    def ratio(k: int) -> float:
        mean = summed[k] / llm_ranks
        return peaks[k] / mean if mean > 0 else 1.0

    out = {
        "encoder_s_max": peaks[0],
        "encoder_s_mean": summed[0] / world,
        "llm_s_max": peaks[1],
        "llm_s_mean": summed[1] / world,
        "imbalance_pred_encoder": ratio(2),
        "imbalance_pred_llm": ratio(3),
        "imbalance_pred_total": ratio(4),
        "balance_s": peaks[5],
        "bubble_pct": 100 * summed[6] / llm_ranks,
    }
    if replica.encoders:
        out.update(handoff_bytes=summed[7], lssp_items=replica.encoders.metrics["lssp_items"])
    return out
