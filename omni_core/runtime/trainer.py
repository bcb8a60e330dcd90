"""The training loop: data parallel over all ranks, exact global token-mean loss, DCP checkpoints.

Read top to bottom: `train()` builds data, model and optimizer, resumes from the newest complete
checkpoint, then runs `step()` until `train.steps`, logging through a tracker (a null one on ranks other
than 0) and checkpointing every `train.ckpt_every` steps and at the end.

Data parallelism here is gradient all-reduce after backward. Each rank backpropagates its loss *sum*
divided by the global number of target tokens of the step, so the summed gradient is exactly the
gradient of the global token mean; encoders that saw no input on a rank contribute zeros and still join
the collective, so no rank waits on another. The 5D layouts (FSDP/TP/PP/CP/EP) come with their own plan
object (`ParallelPlan`); until they are implemented a recipe that asks for them is refused, not silently
run as DP. dp_replicate x dp_shard both map onto this replicated all-reduce (no parameter sharding yet).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from omni_core.data.batch import PackedBatch
from omni_core.data.dataset import ManifestDataset
from omni_core.data.loader import PackedLoader
from omni_core.data.synthetic import ensure_dataset
from omni_core.data.tokenizer import PAD_ID
from omni_core.models.omni import OmniModel, build_model
from omni_core.parallel import ParallelPlan, PlanError
from omni_core.parallel.parallelize import parallelize_omni
from omni_core.recipe.schema import ParallelConfig, Recipe, recipe_hash
from omni_core.results import TrainResult
from omni_core.runtime.checkpoint import (
    checkpoint_cache,
    checkpoint_store,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from omni_core.runtime.dist import DistInfo, all_reduce_sum, barrier
from omni_core.runtime.loss import summarize, token_loss_sums
from omni_core.runtime.perf import device_peak_flops, peak_memory_mb
from omni_core.tracking import NullTracker, Tracker

Log = Callable[[str], None]


def executable_plan(parallel: ParallelConfig, world_size: int) -> ParallelPlan:
    """The recipe's plan on this world, refused if it needs degrees this runtime does not execute yet."""
    plan = ParallelPlan.from_config(parallel, world_size)
    unsupported = [f"parallel.{d}={getattr(plan, d)}" for d in ("tp", "pp", "cp", "ep") if getattr(plan, d) > 1]
    if unsupported:
        raise PlanError(
            f"{', '.join(unsupported)} (plan {plan.name}): this runtime executes data parallelism only; "
            "TP/PP/CP/EP are not implemented yet, so these degrees must be 1"
        )
    return plan


def lr_lambda(step: int, *, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up, then cosine decay to `floor` (a share of the peak lr) at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def freeze(model: OmniModel, parts: list[str]) -> None:
    for part in parts:
        for param in getattr(model, part).parameters():
            param.requires_grad_(False)


def build_optimizer(model: torch.nn.Module, recipe: Recipe) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms, biases, or 1-D embeddings of positions)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": recipe.train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=recipe.train.lr, betas=recipe.train.betas)


def synchronize_gradients(params: list[torch.nn.Parameter]) -> None:
    """Give every trainable parameter a gradient, summed over ranks in one flat buffer.

    A parameter with no gradient (an encoder whose modality was absent from this rank's batch) gets
    zeros, on every world size alike: ranks join the same collective, the optimizer keeps state for
    every parameter (so checkpoints always hold it), and one process behaves like many.
    """
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return
    grads = [p.grad for p in params]
    flat = all_reduce_sum(_flatten_dense_tensors(grads))
    for param, reduced in zip(params, _unflatten_dense_tensors(flat, grads), strict=True):
        param.grad = reduced


@dataclass
class StepStats:
    metrics: dict[str, float]
    tokens: int  # real (non-padding) tokens processed by all ranks
    samples: int
    flops: float  # model FLOPs (forward + backward) of the step over all ranks


def train_step(
    model: OmniModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batches: list[PackedBatch],
    *,
    grad_clip: float,
    compute_dtype: torch.dtype = torch.float32,
) -> StepStats:
    """One optimizer step over this rank's micro-batches (gradient accumulation) and all ranks' data."""
    params = [p for p in model.parameters() if p.requires_grad]
    local = torch.tensor(
        [
            sum(b.num_loss_tokens for b in batches),
            sum(b.num_samples for b in batches),
            sum(int((b.input_ids != PAD_ID).sum()) for b in batches),
            sum(model.train_flops(b) for b in batches),
        ],
        dtype=torch.float64,
    )
    global_targets, global_samples, global_tokens, global_flops = all_reduce_sum(local).tolist()
    device_type = batches[0].input_ids.device.type
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    stats, aux_total = None, 0.0
    for batch in batches:
        with torch.autocast(device_type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            logits = model(batch)
        sums = token_loss_sums(logits, batch)
        # MoE load balancing: its mean over micro-batches and ranks joins the global token-mean loss
        aux = model.aux_loss / (len(batches) * world)
        (sums.total / max(global_targets, 1.0) + aux).backward()
        aux_total += float(aux.detach())
        stats = sums.stats() if stats is None else stats + sums.stats()
    synchronize_gradients(params)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = summarize(all_reduce_sum(stats))
    if model.args.llm.moe is not None:
        metrics["aux_loss"] = float(all_reduce_sum(torch.tensor([aux_total], dtype=torch.float64)))
    metrics["grad_norm"] = float(grad_norm)
    metrics["lr"] = scheduler.get_last_lr()[0]
    return StepStats(metrics=metrics, tokens=int(global_tokens), samples=int(global_samples), flops=global_flops)


def train(
    recipe: Recipe,
    info: DistInfo,
    *,
    tracker: Tracker | None = None,
    stop_after: int | None = None,
    log: Log = print,
) -> TrainResult:
    """Train to `recipe.train.steps` (or stop early after `stop_after` steps of this call)."""
    tracker = tracker or NullTracker()
    cfg = recipe.train
    plan = executable_plan(recipe.parallel, info.world_size)
    torch.manual_seed(recipe.experiment.seed)

    if info.is_main:
        ensure_dataset(recipe)  # generates synthetic data once; the other ranks wait, then find it
    barrier()
    dataset = ManifestDataset(ensure_dataset(recipe), recipe.data)
    loader = PackedLoader(dataset, recipe.data, "train", info.rank, info.world_size, recipe.experiment.seed)

    model = build_model(
        recipe.model.flavor, patch_size=recipe.data.patch_size, n_mels=recipe.data.n_mels,
        seed=recipe.experiment.seed,
    ).to(info.device)
    freeze(model, recipe.model.freeze)
    parallelize_omni(model, plan, activation_checkpointing=cfg.activation_checkpointing)
    compute_dtype = resolve_dtype(cfg.dtype, info.device)
    peak_flops = device_peak_flops(info.device, compute_dtype)
    optimizer = build_optimizer(model, recipe)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_lambda(s, warmup=cfg.warmup_steps, total=cfg.steps, floor=cfg.min_lr_ratio),
    )

    store = checkpoint_store(recipe)
    history = RunHistory()
    start_step = 0
    resume_from = latest_checkpoint(store) if cfg.resume else None
    if resume_from is not None:
        manifest, rank_state = load_checkpoint(
            resume_from, cache=checkpoint_cache(recipe), model=model, optimizer=optimizer, scheduler=scheduler,
            info=info,
        )
        start_step, history = manifest.step, RunHistory(**manifest.history)
        if rank_state is None:
            log(f"resumed weights from {resume_from} (world {manifest.world_size} -> {info.world_size}); "
                "data order restarts because loader positions are per rank")
        else:
            loader.load_state_dict(rank_state["loader"])
            torch.set_rng_state(rank_state["rng"])
            log(f"resumed from {resume_from} at step {start_step}")
        if start_step >= cfg.steps:
            log(f"already trained to step {start_step}: nothing to do (train.resume=false retrains)")

    rhash = recipe_hash(recipe)
    if info.is_main:
        tracker.set_tags({"plan": plan.name, "recipe.hash": rhash})
        tracker.log_params({"model.num_params": model.num_params(), "runtime.world_size": info.world_size})
        log(f"training {recipe.model.flavor} ({model.num_params():,} params) plan {plan} "
            f"steps {start_step + 1}..{cfg.steps}, checkpoints in {recipe.checkpoint_dir()}")

    def checkpoint(step: int) -> str:
        return save_checkpoint(
            store, step=step, model=model, optimizer=optimizer, scheduler=scheduler,
            rank_state={"loader": loader.state_dict(), "rng": torch.get_rng_state()},
            history=asdict(history), info=info, plan=plan.name, recipe_hash=rhash, keep_last=cfg.keep_last,
        )

    batches: Iterator[PackedBatch] = iter(loader)
    cluster_peak = peak_flops * info.world_size if peak_flops else None
    window = Window(cluster_peak)
    last_ckpt, saved_step = resume_from, start_step
    step = start_step
    logging_s_before = tracker.logging_s
    model.train()
    while step < cfg.steps and (stop_after is None or step - start_step < stop_after):
        step += 1
        step_start = time.perf_counter()
        micro = [next(batches).to(info.device) for _ in range(cfg.grad_accum)]
        result = train_step(
            model, optimizer, scheduler, micro, grad_clip=cfg.grad_clip, compute_dtype=compute_dtype
        )
        window.add(result)
        if step % cfg.log_every == 0 or step == cfg.steps:
            metrics = {f"train/{k}": v for k, v in result.metrics.items()}
            metrics.update(window.rates())
            metrics.update({f"data/skipped_{reason}": n for reason, n in loader.stats.items()})
            metrics["perf/peak_mem_mb"] = peak_memory_mb(info.device)
            tracker.log_metrics(metrics, step=step)
            log(f"step {step}/{cfg.steps} loss {result.metrics['loss']:.4f} "
                f"tokens/s {metrics['perf/tokens_per_s']:.0f} lr {result.metrics['lr']:.2e}")
            window = Window(cluster_peak)
        history.record(result, time.perf_counter() - step_start, tracker.logging_s - logging_s_before)
        logging_s_before = tracker.logging_s
        if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps:
            last_ckpt, saved_step = checkpoint(step), step
    if last_ckpt is None or saved_step != step:
        last_ckpt = checkpoint(step)  # stopped early (or nothing saved yet): keep what was trained
    return history.result(
        cluster_peak, steps=step, world_size=info.world_size, plan=plan.name, checkpoint=str(last_ckpt),
        resumed_from_step=start_step, peak_mem_mb=peak_memory_mb(info.device),
    )


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


@dataclass
class Window:
    """Throughput since the last log line; MFU against the peak of all ranks' devices when it is known."""

    peak_flops: float | None
    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    samples: int = 0
    flops: float = 0.0

    def add(self, stats: StepStats) -> None:
        self.tokens += stats.tokens
        self.samples += stats.samples
        self.flops += stats.flops

    def rates(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        rates = {"perf/tokens_per_s": self.tokens / elapsed, "perf/samples_per_s": self.samples / elapsed}
        if self.peak_flops:
            rates["perf/mfu_pct"] = 100.0 * self.flops / elapsed / self.peak_flops
        return rates


@dataclass
class RunHistory:
    """Whole-run figures for the TrainResult, carried across resumes in the checkpoint manifest."""

    initial_loss: float = math.nan
    recent_losses: list[float] = field(default_factory=list)  # the last RECENT steps
    tokens: int = 0
    samples: int = 0
    flops: float = 0.0
    step_s: float = 0.0  # time in steps (data, forward, backward, optimizer, logging); checkpoints excluded
    logging_s: float = 0.0  # of which the caller's time inside tracker calls

    RECENT = 10

    def record(self, stats: StepStats, step_s: float, logging_s: float) -> None:
        if math.isnan(self.initial_loss):
            self.initial_loss = stats.metrics["loss"]
        self.recent_losses = (self.recent_losses + [stats.metrics["loss"]])[-self.RECENT:]
        self.tokens += stats.tokens
        self.samples += stats.samples
        self.flops += stats.flops
        self.step_s += step_s
        self.logging_s += logging_s

    def result(self, peak_flops: float | None, **fields: object) -> TrainResult:
        recent = self.recent_losses or [math.nan]
        seconds = max(self.step_s, 1e-9)
        return TrainResult(
            mfu_pct=100.0 * self.flops / seconds / peak_flops if peak_flops else None,
            initial_loss=self.initial_loss,
            final_loss=sum(recent) / len(recent),
            tokens_per_s=self.tokens / seconds,
            samples_per_s=self.samples / seconds,
            wall_s=self.step_s,
            logging_overhead_pct=100.0 * self.logging_s / seconds,
            **fields,
        )
