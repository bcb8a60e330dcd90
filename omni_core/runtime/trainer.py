"""The training loop under any `ParallelPlan` (data, tensor, pipeline, context and expert parallelism).

Read top to bottom: `train()` runs its phases in order. `set_up` builds data, this rank's model replica
(`replica.build_replica`: split into pipeline stages, then parallelized) and its optimizers; `resume` continues
from the newest complete checkpoint; `run_steps` runs `step.train_step` until `train.steps`, logging through a
tracker (a null one on ranks other than 0) and checkpointing every `train.ckpt_every` steps and at
`train.steps`; the end saves what an early stop trained and returns the run's result. Ranks that differ only
in tp, cp or pp share a data shard (`ModelReplica.data_rank`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from omni_core.common.batch import PackedBatch
from omni_core.common.control import PROGRESS_FILE, TrainProgress, control_dir, launched_unix, read_stop
from omni_core.common.plan import ParallelPlan
from omni_core.common.results import TrainResult
from omni_core.data.balance import balance_for
from omni_core.data.dataset import open_dataset
from omni_core.data.loader import PackedLoader
from omni_core.data.source_base import SKIP_REASONS
from omni_core.data.synthetic import ensure_dataset
from omni_core.recipe.schema import Recipe, recipe_hash
from omni_core.runtime.checkpoint import (
    init_location,
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    save_checkpoint,
)
from omni_core.runtime.ckpt_store import CheckpointStore, checkpoint_cache, checkpoint_store
from omni_core.runtime.dist import DistInfo, all_reduce_sum, barrier, on_device
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.perf import Peak, device_peak, peak_memory_mb
from omni_core.runtime.plan_rules import resolve_plan, shards_per_node
from omni_core.runtime.replica import ModelReplica, build_replica
from omni_core.runtime.step import StepStats, train_step
from omni_core.tracking import NullTracker, Tracker

Log = Callable[[str], None]


def skipped_over_shards(loader: PackedLoader | None, plan: ParallelPlan, info: DistInfo) -> dict[str, int]:
    """What every data shard's loader skipped so far, by reason, each shard counted once (by its first rank:
    the ranks of one shard read the same samples). A collective: every rank calls it at every log step."""
    stats: dict[str, int] = {}
    if (
        loader is not None
        and min(r for r in range(plan.llm_world_size) if plan.data_rank(r) == plan.data_rank(info.rank)) == info.rank
    ):
        stats = loader.stats
    counts = all_reduce_sum(on_device([stats.get(reason, 0) for reason in SKIP_REASONS], info.device))
    return {reason: int(n) for reason, n in zip(SKIP_REASONS, counts.tolist(), strict=True) if n}


@dataclass
class TrainingRun:
    """What `set_up` builds for one call of `train` on this rank: the plan, the model replica and its optimizers,
    the data loader (None on the encoders' own ranks, which read no batches) and the checkpoint store."""

    recipe: Recipe
    info: DistInfo
    log: Log
    plan: ParallelPlan
    compute_dtype: torch.dtype
    replica: ModelReplica
    optimizers: Optimizers
    loader: PackedLoader | None
    store: CheckpointStore
    peak: Peak | None
    recipe_hash: str

    @property
    def data_shard(self) -> list[int]:
        return [self.replica.data_rank, self.plan.dp]

    @property
    def cluster_peak(self) -> float | None:
        """The peak FLOP/s of all ranks' devices, when the device's is known."""
        return self.peak.flops * self.info.world_size if self.peak and self.peak.flops else None

    def checkpoint(self, step: int, history: RunHistory) -> str:
        """Save every part, the optimizers, this rank's data position and RNG, and the run's history at `step`."""
        return save_checkpoint(
            self.store,
            step=step,
            parts=self.replica.parts,
            optimizers=self.optimizers,
            rank_state={
                "loader": self.loader.state_dict() if self.loader else {},
                "rng": torch.get_rng_state(),
                "data_shard": self.data_shard if self.loader else None,
            },
            history=asdict(history),
            info=self.info,
            plan=self.plan.name,
            recipe_hash=self.recipe_hash,
            keep_last=self.recipe.train.keep_last,
        )


@dataclass
class Progress:
    """How far this call got: the last step trained, and the last checkpoint written (or resumed from) and its
    step."""

    step: int
    checkpoint: str | None
    saved_step: int


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
    run = set_up(recipe, info, log)
    start_step, history, resumed_from = resume(run)
    announce(run, tracker, start_step)
    step_s_before, samples_before = history.step_s, history.samples
    progress = Progress(start_step, resumed_from, start_step)
    run_steps(run, tracker, history, progress, started=started, stop_after=stop_after, save=save)
    if save and (progress.checkpoint is None or progress.saved_step != progress.step):
        progress.checkpoint = run.checkpoint(progress.step, history)  # stopped early (or nothing saved yet)
    if run.replica.meshes:  # a failed run skips this: its process is about to exit, and a peer may be gone
        run.replica.meshes.release()
    return history.result(
        run.cluster_peak,
        steps=progress.step,
        world_size=info.world_size,
        plan=run.plan.name,
        checkpoint=str(progress.checkpoint or ""),
        resumed_from_step=start_step,
        peak_mem_mb=peak_memory_mb(info.device),
        mfu_peak=run.peak.name if run.peak else "",
        launch_step_s=history.step_s - step_s_before,
        launch_samples=history.samples - samples_before,
    )


def set_up(recipe: Recipe, info: DistInfo, log: Log) -> TrainingRun:
    """The plan on this world, the dataset (rank 0 writes a synthetic one while the others wait), this rank's
    model replica (`replica.build_replica`: split into pipeline stages, then parallelized), its data loader and
    its optimizers."""
    plan = resolve_plan(recipe, info.world_size)
    torch.manual_seed(recipe.experiment.seed)
    if info.is_main:
        ensure_dataset(recipe)  # generates synthetic data once; the other ranks wait, then find it
    barrier()
    compute_dtype = resolve_dtype(recipe.train.dtype, info.device)
    replica = build_replica(recipe, plan, info, compute_dtype)
    dataset = open_dataset(recipe)
    # the encoders' own ranks (`disaggregated`) read no batches: the LLM ranks' items reach them in the step
    loader = (
        PackedLoader(
            dataset,
            recipe.data,
            "train",
            replica.data_rank,
            plan.dp,
            recipe.experiment.seed,
            balance_for(recipe, replica.data_rank, plan.dp, shards_per_node(plan, info.world_size)),
            device=info.device,  # on CUDA pinned and copied a batch ahead
        )
        if replica.loads_data
        else None
    )
    peak = device_peak(info.device, compute_dtype)
    optimizers = Optimizers(replica.parts, recipe)
    store = checkpoint_store(recipe)
    return TrainingRun(
        recipe, info, log, plan, compute_dtype, replica, optimizers, loader, store, peak, recipe_hash(recipe)
    )


def resume(run: TrainingRun) -> tuple[int, RunHistory, str | None]:
    """The step, history and checkpoint this call continues from: the newest complete checkpoint under
    `train.resume` (its weights, optimizers and, where this rank's data shard was saved, data position and
    RNG restored), else step 0."""
    cfg, plan, store, log = run.recipe.train, run.plan, run.store, run.log
    resume_from = latest_checkpoint(store) if cfg.resume else None
    if not cfg.resume and (earlier := store.steps()):
        folder = store.location(earlier[-1]).rsplit("/", 1)[0]
        log(
            f"train.resume=false: the checkpoints of steps {earlier} in {folder} "
            "belong to an earlier run; this run's saves replace them"
        )
    if resume_from is None:
        if run.recipe.model.init_from is not None:  # a fresh run of a stage that starts from another's weights
            location = init_location(run.recipe, run.info)
            cache = checkpoint_cache(run.recipe)
            manifest = load_weights(location, cache=cache, parts=run.replica.parts, info=run.info)
            log(f"weights from {location} (step {manifest.step}, plan {manifest.plan}); optimizer and data start anew")
        return 0, RunHistory(), None
    manifest, rank_state = load_checkpoint(
        resume_from,
        cache=checkpoint_cache(run.recipe),
        parts=run.replica.parts,
        optimizers=run.optimizers,
        info=run.info,
        plan=plan.name,
        data_shard=run.data_shard,
    )
    start_step, history = manifest.step, RunHistory(**manifest.history)
    if rank_state is None:
        log(
            f"resumed weights from {resume_from} (plan {manifest.plan} -> {plan.name}); data order restarts: "
            f"no rank of the checkpoint read data shard {run.replica.data_rank} of {plan.dp}"
        )
    else:
        order = restore_rank_state(run.loader, rank_state)
        if manifest.plan != plan.name:
            detail = f" (plan {manifest.plan} -> {plan.name}); {order}"
        else:
            detail = "" if order == DATA_ORDER_KEPT else f"; {order}"
        log(f"resumed from {resume_from} at step {start_step}{detail}")
    if start_step >= cfg.steps:
        log(f"already trained to step {start_step}: nothing to do (train.resume=false retrains)")
    return start_step, history, resume_from


DATA_ORDER_KEPT = "data order kept"


def restore_rank_state(loader: PackedLoader | None, rank_state: dict[str, Any]) -> str:
    """Put this rank's loader back where the checkpoint left it, unless its balancing changed, and restore the
    RNG; returns what became of the data order, for the log."""
    order = DATA_ORDER_KEPT
    if loader is not None:
        saved = rank_state["loader"].get("balance", "none")
        if saved != loader.balance.identity:
            order = f"data order restarts: the loaders' balancing changed ({saved} -> {loader.balance.identity})"
        else:
            loader.load_state_dict(rank_state["loader"])
    torch.set_rng_state(rank_state["rng"])
    return order


def model_name(recipe: Recipe) -> str:
    """What the log calls the model: its flavor, or the pretrained parts' folders it is built from."""
    parts = {part: folder for part, folder in recipe.model.pretrained.model_dump().items() if folder}
    if not parts:
        return recipe.model.flavor
    names = " + ".join(f"{part} {Path(folder).name}" for part, folder in parts.items())
    return names if len(parts) == 3 else f"{names} (otherwise the {recipe.model.flavor} flavor)"


def announce(run: TrainingRun, tracker: Tracker, start_step: int) -> None:
    """Rank 0 tags the tracker's run, logs its parameters and says what it trains."""
    if not run.info.is_main:
        return
    recipe, peak = run.recipe, run.peak
    tracker.set_tags(
        {"plan": run.plan.name, "recipe.hash": run.recipe_hash, "perf.mfu_peak": peak.name if peak else "unknown"}
    )
    tracker.log_params({"model.num_params": run.replica.num_params(), "runtime.world_size": run.info.world_size})
    run.log(
        f"training {model_name(recipe)} ({run.replica.num_params():,} params) plan {run.plan} "
        f"steps {start_step + 1}..{recipe.train.steps}, checkpoints in {recipe.checkpoint_dir()}"
    )


def run_steps(
    run: TrainingRun,
    tracker: Tracker,
    history: RunHistory,
    progress: Progress,
    *,
    started: float,
    stop_after: int | None,
    save: bool,
) -> None:
    """The loop: `train_step` until the last step (or `stop_after` steps of this call), a log line and
    tracker metrics every `train.log_every` steps, a checkpoint every `train.ckpt_every` steps and at
    `train.steps`, and a stop at a checkpoint when a watcher asked for one."""
    cfg, info = run.recipe.train, run.info
    start_step = progress.step
    batches: Iterator[PackedBatch] | None = iter(run.loader) if run.loader else None
    window = Window(run.cluster_peak)
    control = Control(control_dir() if info.is_main else None, cfg.steps, run.plan.name, start_step, info.device)
    logging_s_before = tracker.logging_s
    run.replica.train()
    last_step = min(cfg.steps, cfg.stop_at_step or cfg.steps)
    while progress.step < last_step and (stop_after is None or progress.step - start_step < stop_after):
        progress.step += 1
        step = progress.step
        step_start = time.perf_counter()
        if step == start_step + 1:
            control.startup_s = time.time() - started
        micro = [next(batches) for _ in range(cfg.grad_accum)] if batches else []  # on info.device
        result = train_step(
            run.replica, run.optimizers, micro, grad_clip=cfg.grad_clip, compute_dtype=run.compute_dtype
        )
        window.add(result)
        if step % cfg.log_every == 0 or step == last_step:
            log_step(run, tracker, control, window, history, result, step)
            window = Window(run.cluster_peak)
        history.record(result, time.perf_counter() - step_start, tracker.logging_s - logging_s_before)
        logging_s_before = tracker.logging_s
        if save and ((cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps):
            saving = time.perf_counter()
            progress.checkpoint, progress.saved_step = run.checkpoint(step, history), step
            control.ckpt_s = time.perf_counter() - saving
            window.exclude(control.ckpt_s)
            if step < last_step and control.stop_requested():
                run.log(f"stopping at step {step} as the watcher asked (re-plan); checkpoint {progress.checkpoint}")
                break


def log_step(
    run: TrainingRun,
    tracker: Tracker,
    control: Control,
    window: Window,
    history: RunHistory,
    result: StepStats,
    step: int,
) -> None:
    """A log step: the step's metrics, the window's rates, what the loaders skipped and the peak memory to the
    tracker, the progress to the control folder, and a line to the log (every rank joins the skip count)."""
    metrics = {f"train/{k}": v for k, v in result.metrics.items()}
    metrics.update(window.rates())
    skipped = skipped_over_shards(run.loader, run.plan, run.info)
    metrics.update({f"data/skipped_{reason}": n for reason, n in skipped.items()})
    metrics["perf/peak_mem_mb"] = peak_memory_mb(run.info.device)
    metrics["perf/step_s"] = window.seconds() / window.steps
    tracker.log_metrics(metrics, step=step)
    control.report(step, history.samples + window.samples, metrics["perf/step_s"])
    run.log(
        f"step {step}/{run.recipe.train.steps} loss {result.metrics['loss']:.4f} "
        f"tokens/s {metrics['perf/tokens_per_s']:.0f} lr {result.metrics['lr']:.2e}"
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
    device: torch.device  # the step's: the stop decision's all-reduce runs there, beside the step's own
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
        asked = on_device([float(self.folder is not None and read_stop(self.folder) is not None)], self.device)
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

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` spent between steps (a checkpoint save) out of the window's rates, as the run's
        step time leaves them out: the watcher weighs a re-plan's gain in these seconds against its cost."""
        self.started += seconds

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
        self.recent_losses = [*self.recent_losses, stats.metrics["loss"]][-self.RECENT :]
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
