"""The training loop under any `ParallelPlan` (data, tensor, pipeline, context and expert parallelism).

Read top to bottom: `train()` builds data, this rank's model replica (step.build_replica: split into
pipeline stages, then parallelized) and its optimizers, resumes from the newest complete checkpoint, then
runs `step.train_step` until `train.steps`, logging through a tracker (a null one on ranks other than 0)
and checkpointing every `train.ckpt_every` steps and at the end. Ranks that differ only in tp, cp or pp
share a data shard (`ModelReplica.data_rank`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from omni_core.common.batch import PackedBatch
from omni_core.common.control import PROGRESS_FILE, TrainProgress, control_dir, launched_unix, read_stop
from omni_core.common.plan import ParallelPlan
from omni_core.common.results import TrainResult
from omni_core.data.balance import balance_for
from omni_core.data.dataset import open_dataset
from omni_core.data.loader import PackedLoader
from omni_core.data.sources import SKIP_REASONS
from omni_core.data.synthetic import ensure_dataset
from omni_core.models.flavors import get_flavor
from omni_core.recipe.schema import Recipe, recipe_hash
from omni_core.runtime.checkpoint import (
    checkpoint_cache,
    checkpoint_store,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from omni_core.runtime.dist import DistInfo, all_reduce_sum, barrier
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.perf import device_peak, peak_memory_mb
from omni_core.runtime.replica import build_replica, shards_per_node
from omni_core.runtime.step import StepStats, train_step
from omni_core.tracking import NullTracker, Tracker

Log = Callable[[str], None]


def skipped_over_shards(loader: PackedLoader | None, plan: ParallelPlan, info: DistInfo) -> dict[str, int]:
    """What every data shard's loader skipped so far, by reason, each shard counted once (by its first rank:
    the ranks of one shard read the same samples). A collective: every rank calls it at every log step."""
    first = (
        loader is not None
        and min(r for r in range(plan.llm_world_size) if plan.data_rank(r) == plan.data_rank(info.rank)) == info.rank
    )
    stats = loader.stats if first else {}
    counts = torch.tensor(
        [float(stats.get(reason, 0)) for reason in SKIP_REASONS], dtype=torch.float64, device=info.device
    )
    all_reduce_sum(counts)
    return {reason: int(n) for reason, n in zip(SKIP_REASONS, counts.tolist(), strict=True) if n}


def resolve_plan(recipe: Recipe, world_size: int) -> ParallelPlan:
    """The recipe's plan on this world, checked against the model and the packed sequence length."""
    plan = ParallelPlan.from_config(recipe.parallel, world_size)
    llm = get_flavor(recipe.model.flavor, patch_size=recipe.data.patch_size, n_mels=recipe.data.n_mels).llm
    plan.check_model(llm.shape(seq_len=recipe.data.seq_len * recipe.data.micro_batch))
    plan.check_microbatches(recipe.train.grad_accum)
    return plan


def train(
    recipe: Recipe,
    info: DistInfo,
    *,
    tracker: Tracker | None = None,
    stop_after: int | None = None,
    log: Log = print,
    save: bool = True,
) -> TrainResult:
    """Train to `recipe.train.steps`, or stop early at `train.stop_at_step` (a scheduler's segment end) or
    after `stop_after` steps of this call; an early stop checkpoints where it stops. `save=False` writes no
    checkpoint at all (runs that only measure steps: the estimator's validation). With a control folder
    (`common.control`), rank 0 reports progress there at every log step, and the run stops at the first
    checkpoint after a watcher asked it to (a re-plan)."""
    started = launched_unix() or time.time()  # by the launcher, or this process
    tracker = tracker or NullTracker()
    cfg = recipe.train
    plan = resolve_plan(recipe, info.world_size)
    torch.manual_seed(recipe.experiment.seed)

    if info.is_main:
        ensure_dataset(recipe)  # generates synthetic data once; the other ranks wait, then find it
    barrier()
    compute_dtype = resolve_dtype(cfg.dtype, info.device)
    replica = build_replica(recipe, plan, info, compute_dtype)
    dataset = open_dataset(recipe)
    # the encoders' own ranks (`disaggregated`) read no batches: the LLM ranks' items reach them in the step
    data_shard = [replica.data_rank, plan.dp]
    loader = (
        PackedLoader(
            dataset,
            recipe.data,
            "train",
            replica.data_rank,
            plan.dp,
            recipe.experiment.seed,
            balance_for(recipe, replica.data_rank, plan.dp, shards_per_node(plan, info)),
        )
        if replica.loads_data
        else None
    )
    peak = device_peak(info.device, compute_dtype)
    peak_flops = peak.flops if peak else None
    optimizers = Optimizers(replica.parts, recipe)

    store = checkpoint_store(recipe)
    history = RunHistory()
    start_step = 0
    resume_from = latest_checkpoint(store) if cfg.resume else None
    if not cfg.resume and (earlier := store.steps()):
        log(
            f"train.resume=false: the checkpoints of steps {earlier} in {store.location(earlier[-1]).rsplit('/', 1)[0]} "
            "belong to an earlier run; this run's saves replace them"
        )
    if resume_from is not None:
        manifest, rank_state = load_checkpoint(
            resume_from,
            cache=checkpoint_cache(recipe),
            parts=replica.parts,
            optimizers=optimizers,
            info=info,
            plan=plan.name,
            data_shard=data_shard,
        )
        start_step, history = manifest.step, RunHistory(**manifest.history)
        if rank_state is None:
            log(
                f"resumed weights from {resume_from} (plan {manifest.plan} -> {plan.name}); data order restarts: "
                f"no rank of the checkpoint read data shard {replica.data_rank} of {plan.dp}"
            )
        else:
            saved = rank_state["loader"].get("balance", "none") if loader is not None else None
            order = "data order kept"
            if loader is not None and saved != loader.balance.identity:
                order = f"data order restarts: the loaders' balancing changed ({saved} -> {loader.balance.identity})"
            elif loader is not None:
                loader.load_state_dict(rank_state["loader"])
            torch.set_rng_state(rank_state["rng"])
            log(
                f"resumed from {resume_from} at step {start_step}"
                + (
                    f" (plan {manifest.plan} -> {plan.name}); {order}"
                    if manifest.plan != plan.name
                    else ""
                    if order == "data order kept"
                    else f"; {order}"
                )
            )
        if start_step >= cfg.steps:
            log(f"already trained to step {start_step}: nothing to do (train.resume=false retrains)")

    rhash = recipe_hash(recipe)
    if info.is_main:
        tracker.set_tags({"plan": plan.name, "recipe.hash": rhash, "perf.mfu_peak": peak.name if peak else "unknown"})
        tracker.log_params({"model.num_params": replica.num_params(), "runtime.world_size": info.world_size})
        log(
            f"training {recipe.model.flavor} ({replica.num_params():,} params) plan {plan} "
            f"steps {start_step + 1}..{cfg.steps}, checkpoints in {recipe.checkpoint_dir()}"
        )

    def checkpoint(step: int) -> str:
        return save_checkpoint(
            store,
            step=step,
            parts=replica.parts,
            optimizers=optimizers,
            rank_state={
                "loader": loader.state_dict() if loader else {},
                "rng": torch.get_rng_state(),
                "data_shard": data_shard if loader else None,
            },
            history=asdict(history),
            info=info,
            plan=plan.name,
            recipe_hash=rhash,
            keep_last=cfg.keep_last,
        )

    batches: Iterator[PackedBatch] | None = iter(loader) if loader else None
    cluster_peak = peak_flops * info.world_size if peak_flops else None
    window = Window(cluster_peak)
    last_ckpt, saved_step = resume_from, start_step
    step = start_step
    control = Control(control_dir() if info.is_main else None, cfg.steps, plan.name, start_step)
    logging_s_before = tracker.logging_s
    step_s_before, samples_before = history.step_s, history.samples
    replica.train()
    last_step = min(cfg.steps, cfg.stop_at_step or cfg.steps)
    while step < last_step and (stop_after is None or step - start_step < stop_after):
        step += 1
        step_start = time.perf_counter()
        if step == start_step + 1:
            control.startup_s = time.time() - started
        micro = [next(batches).to(info.device) for _ in range(cfg.grad_accum)] if batches else []
        result = train_step(replica, optimizers, micro, grad_clip=cfg.grad_clip, compute_dtype=compute_dtype)
        window.add(result)
        if step % cfg.log_every == 0 or step == last_step:
            metrics = {f"train/{k}": v for k, v in result.metrics.items()}
            metrics.update(window.rates())
            metrics.update(
                {f"data/skipped_{reason}": n for reason, n in skipped_over_shards(loader, plan, info).items()}
            )
            metrics["perf/peak_mem_mb"] = peak_memory_mb(info.device)
            metrics["perf/step_s"] = window.seconds() / window.steps
            tracker.log_metrics(metrics, step=step)
            control.report(step, history.samples + window.samples, metrics["perf/step_s"])
            log(
                f"step {step}/{cfg.steps} loss {result.metrics['loss']:.4f} "
                f"tokens/s {metrics['perf/tokens_per_s']:.0f} lr {result.metrics['lr']:.2e}"
            )
            window = Window(cluster_peak)
        history.record(result, time.perf_counter() - step_start, tracker.logging_s - logging_s_before)
        logging_s_before = tracker.logging_s
        if save and ((cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps):
            saving = time.perf_counter()
            last_ckpt, saved_step = checkpoint(step), step
            control.ckpt_s = time.perf_counter() - saving
            if step < last_step and control.stop_requested():
                log(f"stopping at step {step} as the watcher asked (re-plan); checkpoint {last_ckpt}")
                break
    if save and (last_ckpt is None or saved_step != step):
        last_ckpt = checkpoint(step)  # stopped early (or nothing saved yet): keep what was trained
    if replica.meshes:  # a failed run skips this: its process is about to exit, and a peer may be gone
        replica.meshes.release()
    return history.result(
        cluster_peak,
        steps=step,
        world_size=info.world_size,
        plan=plan.name,
        checkpoint=str(last_ckpt or ""),
        resumed_from_step=start_step,
        peak_mem_mb=peak_memory_mb(info.device),
        mfu_peak=peak.name if peak else "",
        launch_step_s=history.step_s - step_s_before,
        launch_samples=history.samples - samples_before,
    )


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


@dataclass
class Control:
    """Rank 0's side of the control folder (`common.control`); inert without one, and on other ranks, which
    only join the stop decision's all-reduce."""

    folder: Path | None
    steps: int
    plan: str
    resumed_from_step: int
    startup_s: float = 0.0
    ckpt_s: float = 0.0

    def report(self, step: int, samples: int, step_s: float) -> None:
        if self.folder is not None:
            TrainProgress(
                step=step,
                steps=self.steps,
                plan=self.plan,
                samples=samples,
                step_s=step_s,
                startup_s=self.startup_s,
                ckpt_s=self.ckpt_s,
                resumed_from_step=self.resumed_from_step,
                updated_unix=time.time(),
            ).save(self.folder / PROGRESS_FILE)

    def stop_requested(self) -> bool:
        """Whether a watcher asked rank 0 to stop; every rank gets rank 0's answer (all ranks call this)."""
        if control_dir() is None:
            return False
        asked = torch.tensor([float(self.folder is not None and read_stop(self.folder) is not None)])
        return bool(all_reduce_sum(asked).item())


@dataclass
class Window:
    """Throughput since the last log line; MFU against the peak of all ranks' devices when it is known."""

    peak_flops: float | None
    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    tokens: int = 0
    samples: int = 0
    flops: float = 0.0

    def add(self, stats: StepStats) -> None:
        self.steps += 1
        self.tokens += stats.tokens
        self.samples += stats.samples
        self.flops += stats.flops

    def seconds(self) -> float:
        return max(time.perf_counter() - self.started, 1e-9)

    def rates(self) -> dict[str, float]:
        elapsed = self.seconds()
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
        self.recent_losses = (self.recent_losses + [stats.metrics["loss"]])[-self.RECENT :]
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
