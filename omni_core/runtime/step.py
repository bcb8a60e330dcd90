"""One training step under any plan: forward and backward over this rank's micro-batches, the gradients
finished and clipped across meshes (`runtime.gradients`), the optimizers' step (`runtime.optimizer`), and the
step's metrics reduced over all ranks.

The loss is the exact global token mean. Each rank backpropagates the summed loss of the target tokens it
holds divided by the step's global number of targets, so the sum of all ranks' gradients is the gradient
of the global mean: FSDP sums over data- and context-parallel ranks, DTensor handles tensor parallelism,
and pipeline stages each hold their own parameters. Ranks that share a batch (those that differ only in
tp, cp or pp) count its tokens, samples and FLOPs once: sums over the world are divided by those copies.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from omni_core.common.batch import PackedBatch
from omni_core.common.loss import STATS_SIZE, local_targets, summarize, token_loss_sums
from omni_core.runtime.dist import all_reduce_sum
from omni_core.runtime.gradients import clip_grad_norm, fill_missing_grads, replicate_partial_grads
from omni_core.runtime.layout_metrics import LAYOUT_VALUES, layout_metrics, layout_values
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.replica import ModelReplica


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether FSDP reduce-scatters gradients in this backward (a no-op for a model that is not sharded)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


@dataclass
class StepStats:
    metrics: dict[str, float]
    tokens: int  # real (non-padding) tokens processed by all model replicas
    samples: int
    flops: float  # model FLOPs (forward + backward) of the step, counted once per replica


def llm_forward_backward(
    replica: ModelReplica,
    batches: list[PackedBatch],
    encoded: Sequence[torch.Tensor | None],
    global_targets: float,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, float]:
    """The LLM's forward and backward over this rank's micro-batches, pipelined or not: the summed loss
    statistics and this rank's aux-loss total (zeros on the encoders' own ranks, which hold no LLM)."""
    plan, model = replica.plan, replica.parts[0]
    if not replica.loads_data:
        return torch.zeros(STATS_SIZE, dtype=torch.float64), 0.0
    # The MoE balancing loss is a mean over micro-batches and data shards. Context-parallel ranks each hold
    # the whole sequence's loss, and its differentiable all-reduce sums their gradients: hence the cp.
    aux_scale = 1.0 / (len(batches) * plan.dp * plan.cp)
    if replica.pipeline is not None:
        return replica.pipeline.forward_backward(
            batches, global_targets, compute_dtype, aux_scale, encoded if replica.encoders else None
        )
    stats, aux_total = None, 0.0
    device_type = batches[0].input_ids.device.type
    for index, batch in enumerate(batches):
        set_gradient_sync(model, index == len(batches) - 1)  # FSDP reduces once, after the last micro-batch
        with torch.autocast(device_type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            logits = model(batch, encoded=encoded[index])
        sums = token_loss_sums(logits, local_targets(batch, model.token_index))
        assert model.aux_loss is not None  # the forward just run set it
        aux = model.aux_loss * aux_scale
        (sums.total / max(global_targets, 1.0) + aux).backward()
        aux_total += float(aux.detach())
        stats = sums.stats() if stats is None else stats + sums.stats()
    assert stats is not None  # a rank that loads data runs at least one micro-batch
    return stats, aux_total


def global_counts(replica: ModelReplica, batches: list[PackedBatch]) -> tuple[float, float, float, float]:
    """The step's loss targets, samples, real tokens and model FLOPs over all ranks, each batch counted once."""
    model = replica.parts[0]
    local = torch.tensor(
        [
            sum(b.num_loss_tokens for b in batches),
            sum(b.num_samples for b in batches),
            sum(b.layout.real_tokens for b in batches),
            sum(model.train_flops(b) for b in batches),
        ],
        dtype=torch.float64,
    )
    targets, samples, tokens, flops = (all_reduce_sum(local) / replica.batch_copies).tolist()
    return targets, samples, tokens, flops


def train_step(
    replica: ModelReplica,
    optimizers: Optimizers,
    batches: list[PackedBatch],
    *,
    grad_clip: float,
    compute_dtype: torch.dtype = torch.float32,
) -> StepStats:
    """One optimizer step over this rank's micro-batches (gradient accumulation) and all ranks' data."""
    plan = replica.plan
    global_targets, global_samples, global_tokens, global_flops = global_counts(replica, batches)
    encoded = replica.encoders.forward(batches, compute_dtype) if replica.encoders else [None] * len(batches)
    llm_start = time.perf_counter()
    stats, aux_total = llm_forward_backward(replica, batches, encoded, global_targets, compute_dtype)
    llm_s = time.perf_counter() - llm_start
    if replica.encoders:
        replica.encoders.backward()
    params = replica.trainable()
    fill_missing_grads(params)
    replicate_partial_grads(params)
    grad_norm = clip_grad_norm(replica, grad_clip)
    optimizers.step()
    for part in replica.parts:
        part.clear_aux_losses()
    layout = layout_values(replica, batches, llm_s)
    reduced = all_reduce_sum(torch.cat([stats, torch.tensor([aux_total], dtype=torch.float64), layout]))
    losses, aux_sum = reduced[:STATS_SIZE] / plan.tp, reduced[STATS_SIZE] / plan.tp
    layout_sums = reduced[-LAYOUT_VALUES:]
    metrics = summarize(losses)
    if replica.args.llm.moe is not None:
        metrics["aux_loss"] = float(aux_sum)
    metrics["grad_norm"] = grad_norm
    metrics["lr"] = optimizers.lr
    metrics.update(layout_metrics(replica, layout, layout_sums))
    return StepStats(metrics=metrics, tokens=int(global_tokens), samples=int(global_samples), flops=global_flops)
