"""Pipeline parallelism for OmniModel: `pipeline_split` cuts the model into stage chunks, `PipelineRunner` runs
one `torch.distributed.pipelining` schedule (1F1B, GPipe or interleaved 1F1B) over a step's micro-batches.

A chunk is a pruned deep copy of the whole model, as torchtitan builds its stages: the first stage keeps the
token embedding (and, under the `coupled` encoder layout, the encoders and projectors; under `omni` every pp
rank's first chunk holds them, run outside the schedule), the last the final norm and output head, each
stage its own LLM layers. Parameter names stay those of the whole model (`llm.layers.5.attention.wq.weight`
on every plan), so DCP checkpoints reshard between plans. Stage ids are torch's loop style: rank r holds
stages r, r + pp, ...

The loss is the trainer's exact global token mean: the last stage backpropagates each micro-batch's summed
token loss over the step's global target count, and every stage injects the gradient of its own share of the
MoE balancing loss, so pipelined gradients equal the unpipelined gradient accumulation.
"""

from __future__ import annotations

import copy
import functools
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from omni_core.common.batch import PackedBatch
from omni_core.common.loss import STATS_SIZE, local_targets, token_loss_sums
from omni_core.common.plan import ParallelPlan, PlanError
from omni_core.models.args import LLMArgs
from omni_core.models.flops import llm_block_matmul_params
from omni_core.models.omni import OmniModel

if TYPE_CHECKING:
    from torch.distributed.pipelining.stage import _PipelineStageBase

# --- the split ------------------------------------------------------------------------------------------


def stage_ids(plan: ParallelPlan, pp_rank: int) -> list[int]:
    """The global stage indices rank `pp_rank` holds, in torch's loop style (`pp_rank + i * pp`): the first
    stage is on pp rank 0 and the last on pp rank pp - 1, for every schedule."""
    return [pp_rank + i * plan.pp for i in range(plan.virtual_stages)]


def layer_costs(args: LLMArgs) -> list[float]:
    """Training cost of each LLM layer in units of one transformer block, with the output head's cost added to
    the last layer (the stage holding it always holds the head).

    Blocks are equal. The head costs dim x vocab matmul FLOPs per token against the block's active matmul
    parameters (flops.py's per-token FLOPs; attention's quadratic term, the same in every block and dependent
    on the documents, is left out). The token embedding is a lookup (no FLOPs by flops.py's convention). The
    encoders, on the first stage, are not counted: their cost changes with each step's images and audio while
    the split is fixed for the run (and the `omni` layout spreads them over all stages); ties in the split
    lighten the first stage instead (see `balance_layers`)."""
    costs = [1.0] * args.n_layers
    costs[-1] += args.dim * args.vocab_size / llm_block_matmul_params(args, active=True)
    return costs


def balance_layers(costs: list[float], stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, at least one layer each: the split whose costliest stage is
    cheapest; among those the most even one (least sum of squared stage costs); among those the one whose
    first stages are lightest (the first stage also runs the encoders and, under 1F1B, keeps the most
    micro-batches' activations alive). Raises PlanError when there are more stages than layers."""
    n = len(costs)
    if stages > n:
        raise PlanError(f"{stages} pipeline stages for {n} LLM layers: every stage needs at least one layer")
    prefix = list(itertools.accumulate(costs, initial=0.0))

    def cost(start: int, end: int) -> float:
        return round(prefix[end] - prefix[start], 9)  # rounded: equal stages compare equal

    @functools.cache
    def cheapest_max(start: int, k: int) -> float:
        """The least possible cost of the costliest of k stages holding layers start.."""
        if k == 1:
            return cost(start, n)
        return min(max(cost(start, end), cheapest_max(end, k - 1)) for end in range(start + 1, n - k + 2))

    limit = cheapest_max(0, stages)

    @functools.cache
    def most_even(start: int, k: int) -> tuple[float, tuple[float, ...], tuple[int, ...]] | None:
        """(sum of squares, stage costs, stage sizes) of the best split of layers start.. into k stages
        none over `limit`; None if there is none."""
        if k == 1:
            c = cost(start, n)
            return (c * c, (c,), (n - start,)) if c <= limit else None
        options = []
        for end in range(start + 1, n - k + 2):
            c = cost(start, end)
            if c > limit:
                break
            rest = most_even(end, k - 1)
            if rest is not None:
                options.append((round(c * c + rest[0], 9), (c, *rest[1]), (end - start, *rest[2])))
        return min(options, default=None)

    best = most_even(0, stages)
    assert best is not None  # `limit` is the least maximum over all splits, so one split meets it
    bounds = [0, *itertools.accumulate(best[2])]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def pipeline_split(model: OmniModel, plan: ParallelPlan, pp_rank: int) -> list[OmniModel]:
    """This pp rank's stage chunks (one, or `plan.virtual_stages` for interleaved 1F1B), in stage order.

    Each is a deep copy of `model` with the other stages' layers deleted from `llm.layers`; stages other than
    the first have `llm.tok_embeddings` set to None (OmniModel.forward then continues from the previous
    stage's hidden states), stages other than the last `llm.norm` and `llm.output` (LLM.forward then returns
    hidden states). The encoders and projectors stay on the first stage (`coupled`), or on every pp rank's
    first chunk (`omni`: each rank encodes, outside the pipeline). Layers are balanced by `layer_costs`."""
    if not 0 <= pp_rank < plan.pp:
        raise PlanError(f"pp_rank={pp_rank} is outside pp={plan.pp}")
    num_stages = plan.pp * plan.virtual_stages
    keys = list(model.llm.layers)
    ranges = balance_layers(layer_costs(model.args.llm), num_stages)
    chunks = []
    for stage in stage_ids(plan, pp_rank):
        chunk = copy.deepcopy(model)
        for i, key in enumerate(keys):
            if i not in ranges[stage]:
                del chunk.llm.layers[key]
        if stage > 0:
            _drop(chunk.llm, "tok_embeddings")
        if stage > 0 and (plan.encoders.layout == "coupled" or stage != stage_ids(plan, pp_rank)[0]):
            _drop(chunk, "vision", "audio", "projectors")  # `omni`: every pp rank's first chunk keeps them
        if stage < num_stages - 1:
            _drop(chunk.llm, "norm", "output")
        chunks.append(chunk)
    return chunks


def _drop(module: nn.Module, *names: str) -> None:
    """Empty these submodule slots of a stage chunk: the names stay registered, holding None, which is how
    the models tell a stage without them."""
    for name in names:
        module.register_module(name, None)


# --- the runner -----------------------------------------------------------------------------------------


class _AddAuxGrad(torch.autograd.Function):
    """Identity on a stage's output whose backward also feeds `scale` as the gradient of the stage's MoE aux
    loss (Megatron's MoEAuxLossAutoScaler). The aux loss's gradient then reaches this stage's routers and,
    through the stage input, the earlier stages, without the aux loss being a pipeline output."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_like = (aux.dtype, aux.device)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        dtype, device = ctx.aux_like
        return grad, torch.full((), ctx.scale, dtype=dtype, device=device), None


class _ChunkHooks:
    """Forward hooks that let a chunk (the stage's own module, so that PipelineStage sees an FSDP root as
    such) run inside the schedule: the pre-hook turns the schedule's `micro` index into the micro-batch's
    PackedBatch and enters autocast, the post-hook leaves it and attaches the stage's aux loss. Calls without
    `micro` (outside the runner) pass through untouched.

    They also clock the stage's busy time (`PipelineRunner.busy_s`): each forward from pre- to post-hook, each
    backward from the gradient of the stage's output to that of its input (the token embeddings' output on
    the first stage). The rest of the LLM phase is the pipeline's bubble on this rank."""

    def __init__(self, runner: PipelineRunner, chunk: OmniModel, stage: int):
        self.runner, self.stage = runner, stage
        embeddings = chunk.llm.tok_embeddings
        self.first = embeddings is not None
        self.micro: int | None = None
        self.autocast: torch.autocast | None = None
        self.started = self.backward_started = 0.0
        chunk.register_forward_pre_hook(self.before, with_kwargs=True)
        chunk.register_forward_hook(self.after)
        if embeddings is not None:
            embeddings.register_forward_hook(self.embedded)

    def before(self, chunk: OmniModel, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if "micro" not in kwargs:
            return None
        runner = self.runner
        self.micro = int(kwargs["micro"])
        self.started = time.perf_counter()
        hidden = None if self.first else args[0]
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(self.backward_done)
        dtype = runner.compute_dtype
        self.autocast = torch.autocast(runner.device.type, dtype=dtype, enabled=dtype != torch.float32)
        self.autocast.__enter__()
        # `omni` and `disaggregated`: the micro-batch's encoded rows (under the joint schedule, waited for here)
        encoded = runner.encoded[self.micro] if self.first and runner.encoded else None
        return (runner.batches[self.micro], hidden, encoded), {}

    def after(self, chunk: OmniModel, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if self.autocast is None:
            return None
        self.close()
        aux, scale, micro = chunk.aux_loss, self.runner.aux_scale, self.micro
        assert aux is not None and micro is not None  # set by the forward that just ran, and by `before`
        self.runner.aux[(self.stage, micro)] = aux.detach() * scale
        output = _AddAuxGrad.apply(output, aux, scale) if aux.requires_grad else output
        if output.requires_grad:
            output.register_hook(self.backward_start)
        self.runner.busy_s += time.perf_counter() - self.started
        return output

    def embedded(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self.autocast is not None and output.requires_grad:  # inside the runner's forward
            output.register_hook(self.backward_done)

    def backward_start(self, grad: torch.Tensor) -> None:
        self.backward_started = time.perf_counter()

    def backward_done(self, grad: torch.Tensor) -> None:
        self.runner.busy_s += time.perf_counter() - self.backward_started

    def close(self) -> None:
        """Leave autocast (also after a forward that raised, so that no autocast state outlives the step)."""
        if self.autocast is not None:
            self.autocast.__exit__(None, None, None)
            self.autocast = None


class PipelineRunner:
    """One pipeline schedule over a step's micro-batches, on this rank's chunks (plain, or already wrapped by
    TP / FSDP in place; each chunk is its stage's module, so PipelineStage's FSDP handling applies: no
    gradient reduce-scatter until the last micro-batch).

    How micro-batches reach the stages. Ours are already split (the trainer's gradient-accumulation list) and
    a PackedBatch is not a tensor, but every stage of a data-parallel replica loads the same batches. So the
    public `schedule.step` is given only micro-batch indices: `torch.arange(n)` as the `micro` keyword, which
    torch chunks along dim 0 and hands to every stage's forward with that micro-batch (kwargs reach all
    stages; positional inputs only the first), and as the loss target. Each chunk looks its PackedBatch up
    locally by that index (`_ChunkHooks`), so no schedule's forward order is assumed and no private entry
    point (`_step_microbatches`) is needed.

    Shapes are inferred by PipelineStage on the first step (a forward and an input-only backward of micro-batch
    0 per stage, run once per runner), which covers whatever the chunks produce: [T, dim] hidden states, their
    dtype under autocast or FSDP mixed precision, DTensors under TP, T / cp tokens under CP. It requires every
    micro-batch of every step to have the same shape (the packed loader's fixed T). Loss and aux records of
    that inference are keyed by micro-batch and overwritten by the step.

    Gradients: the schedule's own division by the number of micro-batches is off (`scale_grads=False`): each
    micro-batch already backpropagates its share of the global token mean."""

    def __init__(
        self,
        chunks: list[OmniModel],
        plan: ParallelPlan,
        group: dist.ProcessGroup,
        pp_rank: int,
        device: torch.device,
        n_microbatches: int,
    ):
        if dist.get_rank(group) != pp_rank:
            raise ValueError(f"pp_rank={pp_rank} but this rank is rank {dist.get_rank(group)} of the pp group")
        ids = stage_ids(plan, pp_rank)
        if len(chunks) != len(ids):
            raise ValueError(f"plan {plan.name} puts {len(ids)} stage(s) on each pp rank, got {len(chunks)} chunks")
        num_stages = plan.pp * plan.virtual_stages
        self.device = torch.device(device)
        self.n_microbatches = n_microbatches
        self.last = chunks[-1] if ids[-1] == num_stages - 1 else None
        self.hooks = [_ChunkHooks(self, chunk, stage) for chunk, stage in zip(chunks, ids, strict=True)]
        stages: list[_PipelineStageBase] = [
            PipelineStage(chunk, stage, num_stages, self.device, group=group)
            for chunk, stage in zip(chunks, ids, strict=True)
        ]
        self.schedule: PipelineScheduleMulti | PipelineScheduleSingle
        if plan.pp_schedule == "Interleaved1F1B":
            self.schedule = ScheduleInterleaved1F1B(
                stages, n_microbatches=n_microbatches, loss_fn=self._loss, scale_grads=False
            )
        else:
            single = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[plan.pp_schedule]
            self.schedule = single(stages[0], n_microbatches=n_microbatches, loss_fn=self._loss, scale_grads=False)
        # per-step state, read by the hooks and the loss
        self.batches: list[PackedBatch] = []
        self.encoded: Sequence[torch.Tensor | None] = []  # `omni`: each micro-batch's encoded rows (stage 0)
        self.global_targets = torch.ones(())
        self.compute_dtype = torch.float32
        self.aux_scale = 0.0
        self.stats: dict[int, torch.Tensor] = {}
        self.aux: dict[tuple[int, int], torch.Tensor] = {}
        self.busy_s = 0.0  # this rank's stage compute in the last step (see `_ChunkHooks`)

    def forward_backward(
        self,
        batches: list[PackedBatch],
        global_targets: torch.Tensor,
        compute_dtype: torch.dtype,
        aux_scale: float,
        encoded: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of every micro-batch through the pipeline, gradients accumulated in the chunks
        (and, under `omni`, in the `encoded` rows' leaves). `global_targets`: the step's target count (at least
        1), a scalar on the device, so that no loss waits for the host.

        Returns the sum over micro-batches of `LossSums.stats()` (on the rank holding the last stage; zeros
        elsewhere) and this rank's stages' aux-loss total, sum over micro-batches of `aux_scale * aux_loss`
        (summed over the pp ranks, it is the replica's whole aux term), both float64 on the device."""
        if len(batches) != self.n_microbatches:
            raise ValueError(f"the schedule runs {self.n_microbatches} micro-batches, got {len(batches)}")
        self.batches, self.global_targets = batches, global_targets
        self.encoded = encoded or []
        self.compute_dtype, self.aux_scale = compute_dtype, aux_scale
        self.stats, self.aux, self.busy_s = {}, {}, 0.0
        index = torch.arange(len(batches))
        try:
            # return_outputs=False: the last stage keeps no logits beyond each micro-batch's loss
            self.schedule.step(target=index, micro=index, return_outputs=False)
        finally:
            for hooks in self.hooks:
                hooks.close()
            self.batches, self.encoded = [], []
        if self.last is None:
            stats = torch.zeros(STATS_SIZE, dtype=torch.float64, device=self.device)
        else:
            stats = torch.stack([self.stats[m] for m in range(len(batches))]).sum(dim=0)
        aux = list(self.aux.values())
        aux_total = (sum(aux[1:], aux[0]) if aux else torch.zeros((), device=self.device)).double()
        return stats, aux_total

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss for micro-batch `target`: its summed token loss over the global target count.
        Under context parallelism the targets are cut to the tokens this rank's LLM holds."""
        micro = int(target)
        assert self.last is not None  # the schedule computes the loss on the last stage only
        batch = local_targets(self.batches[micro], self.last.token_index)
        sums = token_loss_sums(logits, batch)
        self.stats[micro] = sums.stats()
        return sums.total / self.global_targets
