"""One training step under any plan: this rank's model parts, their optimizers, and the step itself.

The loss is the exact global token mean. Each rank backpropagates the summed loss of the target tokens it
holds divided by the step's global number of targets, so the sum of all ranks' gradients is the gradient
of the global mean: FSDP sums over data- and context-parallel ranks, DTensor handles tensor parallelism,
and pipeline stages each hold their own parameters. Ranks that share a batch (those that differ only in
tp, cp or pp) count its tokens, samples and FLOPs once: sums over the world are divided by those copies.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from omni_core.common.batch import PackedBatch
from omni_core.common.loss import STATS_SIZE, local_targets, summarize, token_loss_sums
from omni_core.common.plan import ParallelPlan, PlanError
from omni_core.common.tokenizer import PAD_ID
from omni_core.data.balance import balance_group_size
from omni_core.models.omni import OmniModel, build_model
from omni_core.parallel.parallelize import ParallelMeshes, build_meshes, encoder_modules, parallelize_omni
from omni_core.recipe.schema import Recipe
from omni_core.runtime.dist import DistInfo, all_reduce_sum

ENCODER_PREFIXES = ("vision.", "audio.", "projectors.")


@dataclass
class ModelReplica:
    """This rank's share of the model: one part, or several pipeline stage chunks, laid out by `plan`."""

    plan: ParallelPlan
    parts: list[OmniModel]
    meshes: ParallelMeshes | None  # None on a single process
    pipeline: object | None = None  # parallel.pipeline.PipelineRunner when plan.pp > 1
    encoders: object | None = None  # parallel.encoders.EncoderStep under `omni` and `disaggregated` (several ranks)

    @property
    def args(self):
        return self.parts[0].args

    @property
    def data_rank(self) -> int:
        return self.meshes.dp_rank if self.meshes else 0

    @property
    def loads_data(self) -> bool:
        """Whether this rank reads batches: every LLM rank (not the encoders' own, under `disaggregated`)."""
        rank = dist.get_rank() if self.meshes is not None else 0
        return rank < self.plan.llm_world_size

    @property
    def batch_copies(self) -> int:
        """Ranks that load the same batch: they differ only in tp, cp or pp."""
        return self.plan.tp * self.plan.cp * self.plan.pp

    def trainable(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters() if p.requires_grad]

    def num_params(self) -> int:
        """Parameters of the whole model (not this rank's shard)."""
        from omni_core.models.flops import omni_params

        return omni_params(self.args)["total"]

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)


def shards_per_node(plan: ParallelPlan, info: DistInfo) -> int:
    """Data shards whose ranks share this node (torchrun's LOCAL_WORLD_SIZE; one node when it is unset): the
    default balancing group."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    return max(1, min(plan.dp, local * plan.dp // plan.llm_world_size))


def check_buildable(plan: ParallelPlan, compile: bool = False) -> None:
    """Refuse what the estimator prices but the runtime does not build (PlanError), before any rank starts."""
    sharded = plan.encoders.sharded
    if sharded and compile:
        raise PlanError(
            f"plan {plan.name}: encoders.{sharded[0]}.fsdp with train.compile is not built (a step "
            "installs the gathered weights in the encoder blocks, which compiled blocks were not tested "
            "with); set train.compile=false or replicate the encoder"
        )


def build_replica(recipe: Recipe, plan: ParallelPlan, info: DistInfo, compute_dtype: torch.dtype) -> ModelReplica:
    """Build the full model from the seed (identical on every rank), then split and parallelize it. On one
    process `omni` is the same placement as `coupled` (the encoders on the one rank) and runs as it. Under
    `disaggregated` the encoders' own ranks keep only the encoders, the LLM ranks only the LLM."""
    check_buildable(plan, recipe.train.compile)
    meshes = build_meshes(plan, info.device.type) if info.world_size > 1 else None
    model = build_model(
        recipe.model.flavor,
        patch_size=recipe.data.patch_size,
        n_mels=recipe.data.n_mels,
        seed=recipe.experiment.seed,
    ).to(info.device)
    for name in recipe.model.freeze:
        for param in getattr(model, name).parameters():
            param.requires_grad_(False)
    encoders_train = any(p.requires_grad for m in encoder_modules(model) for p in m.parameters())
    if info.rank >= plan.llm_world_size:  # one of the encoders' own ranks
        model.llm = None
        parts = [model]
    else:
        if plan.encoders.layout == "disaggregated":
            model.vision = model.audio = model.projectors = None
        parts = llm_parts(model, plan, meshes, recipe, compute_dtype)
    replica = ModelReplica(plan, parts, meshes)
    tokens = recipe.data.seq_len * recipe.data.micro_batch
    if plan.encoders.layout != "coupled" and meshes is not None:
        from omni_core.parallel.encoders import EncoderStep

        balance = recipe.data.balance
        group = balance_group_size(balance.policy, balance.group_size, plan.dp, shards_per_node(plan, info))
        replica.encoders = EncoderStep(parts[0], plan, tokens, encoders_train, info.device, group)
    if plan.pp > 1 and replica.loads_data:
        from omni_core.parallel.pipeline import PipelineRunner

        replica.pipeline = PipelineRunner(
            parts, plan, meshes.group("pp"), meshes.pp_rank, info.device, recipe.train.grad_accum
        )
    return replica


def llm_parts(
    model: OmniModel, plan: ParallelPlan, meshes: ParallelMeshes | None, recipe: Recipe, compute_dtype: torch.dtype
) -> list[OmniModel]:
    """This LLM rank's model parts (pipeline stage chunks), each parallelized by the plan."""
    if plan.pp > 1:
        from omni_core.parallel.pipeline import pipeline_split

        parts = pipeline_split(model, plan, meshes.pp_rank)
    else:
        parts = [model]
    for part in parts:
        parallelize_omni(
            part,
            plan,
            meshes,
            tokens_per_microbatch=recipe.data.seq_len * recipe.data.micro_batch,
            activation_checkpointing=recipe.train.activation_checkpointing,
            compile=recipe.train.compile,
            param_dtype=compute_dtype,
        )
    return parts


def lr_lambda(step: int, *, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up, then cosine decay to `floor` (a share of the peak lr) at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class Optimizers:
    """AdamW + LR schedule per model part (torchtitan's container): each part's optimizer state is keyed
    by that part's parameter names, which are the whole model's, so checkpoints reshard across plans."""

    def __init__(self, parts: list[nn.Module], recipe: Recipe):
        cfg = recipe.train
        self.optimizers = [build_optimizer(part, recipe) for part in parts]
        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: lr_lambda(s, warmup=cfg.warmup_steps, total=cfg.steps, floor=cfg.min_lr_ratio)
            )
            for opt in self.optimizers
        ]

    def step(self) -> None:
        for opt, sched in zip(self.optimizers, self.schedulers, strict=True):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def scheduler_state(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_scheduler_state(self, state: dict) -> None:
        """Every group of every part shares one base LR and one schedule, but how many groups there are
        depends on the plan (`build_optimizer`): the saved per-group lists are resized to this plan's."""
        for opt, sched in zip(self.optimizers, self.schedulers, strict=True):
            groups = len(opt.param_groups)
            sched.load_state_dict(
                {**state, "base_lrs": state["base_lrs"][:1] * groups, "_last_lr": state["_last_lr"][:1] * groups}
            )


def build_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms, biases, or 1-D embeddings of positions).

    It runs the foreach implementation (a few batched operators per group instead of ~15 per tensor; on CPU
    PyTorch's default is the per-tensor loop, and on DTensors each of those operators pays DTensor's
    dispatch). A foreach group must be homogeneous, so parameters are grouped by decay and by kind: plain
    tensors, or DTensors of one mesh (FSDP's, the experts', TP's)."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, list[nn.Parameter]] = defaultdict(list)
    for param in model.parameters():
        if param.requires_grad:
            mesh = param.device_mesh if isinstance(param, DTensor) else None
            groups[(param.ndim >= 2, mesh)].append(param)
    decay = recipe.train.weight_decay
    return torch.optim.AdamW(
        [{"params": params, "weight_decay": decay if matrix else 0.0} for (matrix, _), params in groups.items()],
        lr=recipe.train.lr,
        betas=recipe.train.betas,
        foreach=True,
    )


def replicate_partial_grads(params: list[nn.Parameter]) -> None:
    """Sum the gradients DTensor leaves partial (TP-replicated weights, e.g. the norms before sequence-sharded
    inputs) with one flat all-reduce per (mesh, placements), and make them replicated.

    Left partial, every operator that reads such a gradient all-reduces it again: three per tensor in
    AdamW's foreach step and one in the gradient norm, each paying a collective's latency."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    groups: dict[tuple, list[nn.Parameter]] = defaultdict(list)
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            groups[(grad.device_mesh, grad.placements)].append(param)
    for (mesh, placements), members in groups.items():
        flat = torch.cat([p.grad.to_local().reshape(-1) for p in members])
        for dim, placement in enumerate(placements):
            if not isinstance(placement, Partial):
                continue
            if type(placement) is not Partial or placement.reduce_op not in ("sum", "avg"):  # e.g. a norm's
                raise ValueError(f"gradient partial as {placement}: only sums and averages are reduced")
            dist.all_reduce(flat, group=mesh.get_group(dim))
            if placement.reduce_op == "avg":
                flat /= mesh.size(dim)
        replicated = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
        offset = 0
        for param in members:
            local = param.grad.to_local()
            reduced = flat[offset : offset + local.numel()].view_as(local)
            offset += local.numel()
            param.grad = DTensor.from_local(
                reduced, mesh, replicated, run_check=False, shape=param.grad.shape, stride=param.grad.stride()
            )


def clip_grad_norm(replica: ModelReplica, max_norm: float) -> float:
    """Clip all ranks' gradients together by the norm of the whole model's gradient; returns that norm.

    Sharded (DTensor) gradients are reduced by DTensor per (mesh, placement) group, so replicated copies
    count once; experts under EP differ across the EP group and stages across pipeline ranks, so those
    squares are summed over their groups too. `omni` encoders are replicated on every rank (pipeline ranks
    included) with summed gradients: counted once, after the pipeline's sum."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for part in replica.parts:
        for name, param in part.named_parameters():
            if param.grad is None:
                continue
            grad = param.grad
            kind = "expert" if ".experts." in name else "dense"
            if replica.encoders is not None and name.startswith(ENCODER_PREFIXES):
                kind = "encoder"
            key = (kind, grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else (kind, None, None)
            groups[key].append(grad)
    squares = dict.fromkeys(("dense", "expert", "encoder"), torch.zeros((), dtype=torch.float64))
    for (kind, mesh, _), grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if mesh is not None:
            norm = norm.full_tensor()
        squares[kind] = squares[kind] + norm.detach().double().cpu() ** 2
    meshes = replica.meshes
    if meshes is not None and replica.plan.ep > 1 and replica.loads_data:
        dist.all_reduce(squares["expert"], group=meshes.ep_group)
    total_sq = squares["dense"] + squares["expert"]
    if meshes is not None and replica.plan.pp > 1 and replica.loads_data:
        dist.all_reduce(total_sq, group=meshes.group("pp"))
    if replica.plan.encoders.ranks:  # disaggregated: the LLM's ranks and the encoders' each know their half
        first_encoder_rank = replica.plan.llm_world_size
        rank, zero = dist.get_rank(), torch.zeros_like(total_sq)
        halves = torch.stack(
            [total_sq if rank == 0 else zero, squares["encoder"] if rank == first_encoder_rank else zero]
        )
        dist.all_reduce(halves)
        total_sq, squares["encoder"] = halves[0], halves[1]
    total = float((total_sq + squares["encoder"]).sqrt())
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for grads in groups.values():
            for grad in grads:
                grad.mul_(scale)
    return total


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


def layout_values(replica: ModelReplica, batches: list[PackedBatch], llm_s: float) -> torch.Tensor:
    """This rank's [encoder seconds, LLM seconds, predicted encoder, LLM and total FLOPs, balancing seconds,
    pipeline bubble share, handoff bytes]: summed over the world with the loss statistics (one all-reduce), the
    first six also maxed (`layout_metrics`). The pipeline's bubble is the idle share of the rank's span of
    encoder and LLM work: 1 - (stage compute + encoder compute) / (LLM phase + the encoders' time outside it),
    the same measure for every layout and encoder schedule (a coupled step's encoders run inside stage 0's
    compute; a joint schedule's run inside the LLM phase's waits). The predictions are the loader's cost model
    on this rank's batches (`data.balance`)."""
    encoder = replica.encoders.metrics if replica.encoders else {}
    bubble = 0.0
    if replica.pipeline is not None and llm_s > 0:
        busy = replica.pipeline.busy_s + encoder.get("encoder_s", 0.0)
        bubble = max(0.0, 1.0 - busy / (llm_s + encoder.get("outside_s", 0.0)))
    predicted = [sum(b.predicted_flops[k] for b in batches) for k in (0, 1)]
    return torch.tensor(
        [
            encoder.get("encoder_s", 0.0),
            llm_s,
            *predicted,
            sum(predicted),
            sum(b.balance_s for b in batches),
            bubble,
            encoder.get("handoff_bytes", 0.0),
        ],
        dtype=torch.float64,
    )


LAYOUT_VALUES = 8
PEAKED = 6  # of the layout values, those also maxed over the world


def layout_metrics(replica: ModelReplica, mine: torch.Tensor, summed: torch.Tensor) -> dict[str, float]:
    """Encoder and LLM seconds per rank as max and mean over the world, the predicted imbalance (max / mean
    over the LLM's ranks, which all hold their shard's batches) of the encoders' and the LLM's work, the
    slowest rank's balancing seconds, the bubble's mean over the LLM's ranks, the handoff's bytes and LSSP's
    items (`omni`, `disaggregated`)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    llm_ranks = replica.plan.llm_world_size
    peaks = mine[:PEAKED].clone()
    if world > 1:
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)

    def ratio(k: int) -> float:
        mean = float(summed[k]) / llm_ranks
        return float(peaks[k]) / mean if mean > 0 else 1.0

    out = {
        "encoder_s_max": float(peaks[0]),
        "encoder_s_mean": float(summed[0]) / world,
        "llm_s_max": float(peaks[1]),
        "llm_s_mean": float(summed[1]) / world,
        "imbalance_pred_encoder": ratio(2),
        "imbalance_pred_llm": ratio(3),
        "imbalance_pred_total": ratio(4),
        "balance_s": float(peaks[5]),
        "bubble_pct": 100 * float(summed[6]) / llm_ranks,
    }
    if replica.encoders:
        out.update(handoff_bytes=float(summed[7]), lssp_items=replica.encoders.metrics["lssp_items"])
    return out


def llm_forward_backward(
    replica: ModelReplica,
    batches: list[PackedBatch],
    encoded: list[torch.Tensor | None],
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
        aux = model.aux_loss * aux_scale
        (sums.total / max(global_targets, 1.0) + aux).backward()
        aux_total += float(aux.detach())
        stats = sums.stats() if stats is None else stats + sums.stats()
    return stats, aux_total


def train_step(
    replica: ModelReplica,
    optimizers: Optimizers,
    batches: list[PackedBatch],
    *,
    grad_clip: float,
    compute_dtype: torch.dtype = torch.float32,
) -> StepStats:
    """One optimizer step over this rank's micro-batches (gradient accumulation) and all ranks' data."""
    plan, copies = replica.plan, replica.batch_copies
    model = replica.parts[0]
    local = torch.tensor(
        [
            sum(b.num_loss_tokens for b in batches),
            sum(b.num_samples for b in batches),
            sum(int((b.input_ids != PAD_ID).sum()) for b in batches),
            sum(model.train_flops(b) for b in batches),
        ],
        dtype=torch.float64,
    )
    global_targets, global_samples, global_tokens, global_flops = (all_reduce_sum(local) / copies).tolist()
    encoded = replica.encoders.forward(batches, compute_dtype) if replica.encoders else [None] * len(batches)
    llm_start = time.perf_counter()
    stats, aux_total = llm_forward_backward(replica, batches, encoded, global_targets, compute_dtype)
    llm_s = time.perf_counter() - llm_start
    if replica.encoders:
        replica.encoders.backward()
    params = replica.trainable()
    for param in params:
        if param.grad is None:  # a trainable parameter the step never reached: keep optimizer state uniform
            param.grad = torch.zeros_like(param)
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
