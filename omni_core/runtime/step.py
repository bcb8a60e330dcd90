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
from omni_core.runtime.dist import all_reduce_max, all_reduce_sum, on_device
from omni_core.runtime.gradients import clip_grad_norm, finish_gradients
from omni_core.runtime.layout_metrics import LAYOUT_VALUES, PEAKED, layout_metrics, layout_values
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


def step_device(replica: ModelReplica, batches: list[PackedBatch]) -> torch.device:
    """The device the step computes on: its batches', or on the encoders' own ranks (no batches) theirs."""
    if batches:
        return batches[0].input_ids.device
    if replica.encoders is None:
        raise ValueError("a step without batches runs on the encoders' own ranks, and this rank has no encoders")
    return replica.encoders.device


def llm_forward_backward(
    replica: ModelReplica,
    batches: list[PackedBatch],
    encoded: Sequence[torch.Tensor | None],
    global_targets: torch.Tensor,
    compute_dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The LLM's forward and backward over this rank's micro-batches, pipelined or not: the summed loss
    statistics and this rank's aux-loss total, float64 on the device (zeros on the encoders' own ranks, which
    hold no LLM). `global_targets`: the step's target count (at least 1), a float32 scalar on the device."""
    plan, model = replica.plan, replica.parts[0]
    stats = torch.zeros(STATS_SIZE, dtype=torch.float64, device=device)
    aux_total = torch.zeros((), dtype=torch.float64, device=device)
    if not replica.loads_data:
        return stats, aux_total
    # The MoE balancing loss is a mean over micro-batches and data shards. Context-parallel ranks each hold
    # the whole sequence's loss, and its differentiable all-reduce sums their gradients: hence the cp.
    aux_scale = 1.0 / (len(batches) * plan.dp * plan.cp)
    if replica.pipeline is not None:
        return replica.pipeline.forward_backward(
            batches, global_targets, compute_dtype, aux_scale, encoded if replica.encoders else None
        )
    for index, batch in enumerate(batches):
        set_gradient_sync(model, index == len(batches) - 1)  # FSDP reduces once, after the last micro-batch
        with torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            logits = model(batch, encoded=encoded[index])
        sums = token_loss_sums(logits, local_targets(batch, model.token_index))
        assert model.aux_loss is not None  # the forward just run set it
        aux = model.aux_loss * aux_scale
        (sums.total / global_targets + aux).backward()
        aux_total += aux.detach()
        stats += sums.stats()
    return stats, aux_total


def global_counts(replica: ModelReplica, batches: list[PackedBatch], device: torch.device) -> torch.Tensor:
    """[loss targets, samples, real tokens, model FLOPs] of the step over all ranks, each batch counted once,
    on the device: summed from the batches' host layouts, without reading the device."""
    model = replica.parts[0]
    local = on_device(
        [
            sum(b.num_loss_tokens for b in batches),
            sum(b.num_samples for b in batches),
            sum(b.layout.real_tokens for b in batches),
            sum(model.train_flops(b) for b in batches),
        ],
        device,
    )
    return all_reduce_sum(local) / replica.batch_copies


def train_step(
    replica: ModelReplica,
    optimizers: Optimizers,
    batches: list[PackedBatch],
    *,
    grad_clip: float,
    compute_dtype: torch.dtype = torch.float32,
) -> StepStats:
    """One optimizer step over this rank's micro-batches (gradient accumulation) and all ranks' data.

    Every value the step reduces stays on the device; the host reads them once, at the end (`read_metrics`)."""
    device = step_device(replica, batches)
    counts = global_counts(replica, batches, device)
    encoded = replica.encoders.forward(batches, compute_dtype) if replica.encoders else [None] * len(batches)
    llm_start = time.perf_counter()
    targets = counts[0].clamp(min=1.0).float()  # float32, as the loss it divides
    stats, aux_total = llm_forward_backward(replica, batches, encoded, targets, compute_dtype, device)
    llm_s = time.perf_counter() - llm_start
    if replica.encoders:
        replica.encoders.backward()
    finish_gradients(replica)
    grad_norm = clip_grad_norm(replica, grad_clip, device)
    optimizers.step()
    for part in replica.parts:
        part.clear_aux_losses()
    layout = layout_values(replica, batches, llm_s, device)
    summed = all_reduce_sum(torch.cat([stats, aux_total.reshape(1), layout]))
    peaks = all_reduce_max(layout[:PEAKED].clone())
    return read_metrics(replica, optimizers, torch.cat([counts, summed, peaks, grad_norm.reshape(1)]))


def read_metrics(replica: ModelReplica, optimizers: Optimizers, reduced: torch.Tensor) -> StepStats:
    """The step's metrics from its reduced values, [global counts, summed loss statistics, aux loss and layout
    values, maxed layout values, gradient norm], read to the host in one transfer: the step's one host sync."""
    values = reduced.tolist()
    (_, global_samples, global_tokens, global_flops), values = values[:4], values[4:]
    tp = replica.plan.tp  # tensor-parallel ranks each hold the whole loss: counted tp times in the sum
    losses, aux_sum = [v / tp for v in values[:STATS_SIZE]], values[STATS_SIZE] / tp
    layout_sums = values[STATS_SIZE + 1 : STATS_SIZE + 1 + LAYOUT_VALUES]
    peaks, grad_norm = values[-1 - PEAKED : -1], values[-1]
    metrics = summarize(losses)
    if replica.args.llm.moe is not None:
        metrics["aux_loss"] = aux_sum
    metrics["grad_norm"] = grad_norm
    metrics["lr"] = optimizers.lr
    metrics.update(layout_metrics(replica, layout_sums, peaks))
    return StepStats(metrics=metrics, tokens=int(global_tokens), samples=int(global_samples), flops=global_flops)
