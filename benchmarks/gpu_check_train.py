"""The training parts of benchmarks/gpu_check.py, through the runtime's own entry points: a one-rank process group
from `dist.init_distributed` (NCCL for CUDA tensors on a GPU), `replica.build_replica`, `optimizer.Optimizers`,
the real loader on generated data (`data.source: dynamic`), `step.train_step` and `checkpoint`'s save and load.

Correctness runs a small flavor with every collective on (`OMNI_ALWAYS_COLLECT=1`); throughput runs omni-1b as
a one-GPU job does (the shortcut on), its batches drawn by the loader before the clock starts and brought to the
device by the loader's own prefetcher (pinned, copied a batch ahead on a side stream) inside the timed steps.
"""

from __future__ import annotations

import gc
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gpu_check_measures import skipped

from omni_core.common.plan import ParallelPlan
from omni_core.data.dataset import open_dataset
from omni_core.data.loader import PackedLoader
from omni_core.data.prefetch import DevicePrefetcher
from omni_core.recipe.schema import Recipe
from omni_core.runtime.dist import ALWAYS_COLLECT_ENV, DistInfo, init_distributed
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.perf import device_peak, peak_memory_mb
from omni_core.runtime.replica import ModelReplica, build_replica
from omni_core.runtime.step import StepStats, train_step


@dataclass(frozen=True)
class Sizes:
    """The shapes of one mode: the GPU's, or the CPU dry run's tiny ones."""

    check_flavor: str  # correctness
    check_seq_len: int
    flavor: str  # throughput
    seq_len: int
    warmup_steps: int
    timed_steps: int
    patch_size: int
    image_side_px: int  # every image this square: a fixed number of patches per image
    text_tokens: int  # median tokens of a text-only sample (log-normal)
    n_mels: int
    compile: bool


# 224 px images in 14 px patches: 16 x 16 patches, as CLIP ViT-L/14 sees them, one LLM placeholder each; text
# documents of median 512 tokens (C4's mean is 427).
GPU = Sizes("small", 2048, "omni-1b", 8192, 3, 20, 14, 224, 512, 80, compile=True)
DRY = Sizes("debug", 256, "debug", 256, 1, 2, 8, 64, 32, 32, compile=False)

# Shares of samples. An image sample is an image and its caption (about 26 tokens); a text-only one averages
# 705 tokens (the log-normal's mean): three image samples per text-only one give about as many image tokens as
# text tokens on the GPU (3 x 256 against 705 + 3 x 26). The report gives the ratio measured on the batches.
WORKLOADS = {"text_only": {"text": 1.0}, "image_text_1to1": {"text": 1.0, "image": 3.0}}
CHECK_MIX = {"text": 0.4, "image": 0.4, "audio": 0.2}  # every encoder runs in the correctness steps


def sizes(dry_run: bool) -> Sizes:
    return DRY if dry_run else GPU


def make_recipe(root: Path, s: Sizes, flavor: str, seq_len: int, mix: dict[str, float], **train: Any) -> Recipe:
    """Generated data drawn on the fly at these sizes; `train` overrides the train section."""
    side, median = s.image_side_px, s.text_tokens
    return Recipe.model_validate(
        {
            "experiment": {"name": f"gpu-check-{flavor}", "output_dir": str(root), "seed": 0},
            "data": {
                "source": "dynamic",
                "seq_len": seq_len,
                "micro_batch": 1,
                "patch_size": s.patch_size,
                "n_mels": s.n_mels,
                "max_image_patches": (side // s.patch_size) ** 2,
                "synthetic": {
                    "num_samples": 200,
                    "mix": mix,
                    "image_side_px": {"min": side, "max": side},
                    "text_tokens": {"kind": "lognormal", "min": 16, "max": seq_len, "center": median, "spread": 0.8},
                },
            },
            "model": {"flavor": flavor},
            "train": {
                "steps": 100,
                "warmup_steps": 1,
                "lr": 1e-4,
                "log_every": 1,
                "ckpt_every": 0,
                "resume": False,
                **train,
            },
        }
    )


def join_group() -> DistInfo:
    """A one-rank process group through the runtime's own set-up (on a GPU: NCCL for CUDA tensors, gloo for
    CPU ones), as torchrun's environment would describe it."""
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return init_distributed("auto", timeout_s=120.0)


def draw_batches(recipe: Recipe, count: int) -> list:
    """`count` training batches of the real loader, on the host."""
    loader = iter(PackedLoader(open_dataset(recipe), recipe.data, "train", 0, 1, recipe.experiment.seed))
    return [next(loader) for _ in range(count)]


def one_step(replica: ModelReplica, optimizers: Optimizers, batch, dtype) -> StepStats:
    """One optimizer step on one batch already on the device."""
    return train_step(replica, optimizers, [batch], grad_clip=1.0, compute_dtype=dtype)


def compute_dtype(info: DistInfo) -> torch.dtype:
    """Throughput's precision: bf16 on a GPU; fp32 in a dry run (a CPU without bf16 units is slow at it)."""
    return torch.bfloat16 if info.device.type == "cuda" else torch.float32


# Correctness trains in the GPU's precision on both devices: bf16 parameters, which FSDP2 shards at every world
# size (fp32 ones train unsharded in one process).
CHECK_DTYPE = torch.bfloat16


def fsdp_state(replica: ModelReplica) -> dict[str, Any]:
    """Whether the model is FSDP2-sharded, and the dtypes its parameters are gathered and reduced in."""
    from torch.distributed.fsdp import FSDPModule

    model = replica.parts[0]
    sharded = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    state: dict[str, Any] = {"fsdp_modules": len(sharded)}
    if sharded:
        state_of = getattr(model.get_submodule(sharded[-1]), "_get_fsdp_state", None)  # private, since torch 2.4
        policy = getattr(state_of(), "_mp_policy", None) if state_of else None
        state["param_dtype"] = str(getattr(policy, "param_dtype", None)).removeprefix("torch.")
        state["reduce_dtype"] = str(getattr(policy, "reduce_dtype", None)).removeprefix("torch.")
    return state


def nccl_step_and_checkpoint(ctx) -> dict[str, Any]:
    """Steps on a one-rank group with every collective on; a checkpoint after the first, then the next two
    steps again from it: the same losses (the weights, optimizer state and LR schedule came back)."""
    os.environ[ALWAYS_COLLECT_ENV] = "1"
    info, s = join_group(), sizes(ctx.dry_run)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as root:
        recipe = make_recipe(Path(root), s, s.check_flavor, s.check_seq_len, CHECK_MIX)
        replica = build_replica(recipe, ParallelPlan(), info, CHECK_DTYPE)
        optimizers = Optimizers(replica.parts, recipe)
        batches = draw_batches(recipe, 3)
        with CollectiveCounter() as counts:
            first = one_step(replica, optimizers, batches[0].to(info.device), CHECK_DTYPE)
        before, after = checkpoint_round_trip(recipe, replica, optimizers, info, batches[1:])
    report = {
        "backend": torch.distributed.get_backend(),
        "world_size": info.world_size,
        "compute_dtype": str(CHECK_DTYPE).removeprefix("torch."),
        "flavor": s.check_flavor,
        "loss": first.metrics["loss"],
        "grad_norm": first.metrics["grad_norm"],
        "collectives_in_step": counts.calls,
        **fsdp_state(replica),
        "losses_after_save": before,
        "losses_after_load": after,
    }
    if info.device.type != "cuda":
        report["nccl"] = skipped("no GPU: the one-rank group's backend is gloo")
    problems = step_problems(report)
    return {**report, **({"status": "error", "error": "; ".join(problems)} if problems else {})}


def checkpoint_round_trip(recipe: Recipe, replica, optimizers, info: DistInfo, batches) -> tuple[list, list]:
    """Save, step through `batches`, load, step through them again: the losses of both passes."""
    from omni_core.runtime.checkpoint import load_checkpoint, save_checkpoint
    from omni_core.runtime.ckpt_store import checkpoint_cache, checkpoint_store

    saved = {"parts": replica.parts, "optimizers": optimizers, "info": info}
    location = save_checkpoint(
        checkpoint_store(recipe),
        step=1,
        rank_state={},
        history={},
        plan="dp1",
        recipe_hash="gpu-check",
        keep_last=1,
        **saved,
    )
    before = [one_step(replica, optimizers, b.to(info.device), CHECK_DTYPE).metrics["loss"] for b in batches]
    load_checkpoint(location, cache=checkpoint_cache(recipe), **saved)
    after = [one_step(replica, optimizers, b.to(info.device), CHECK_DTYPE).metrics["loss"] for b in batches]
    return before, after


def step_problems(report: dict[str, Any]) -> list[str]:
    problems = (
        [] if all(map(math.isfinite, [report["loss"], *report["losses_after_save"]])) else ["a loss is not finite"]
    )
    if not report["collectives_in_step"]:
        problems.append(f"no collective ran in the step although {ALWAYS_COLLECT_ENV}=1")
    if report["fsdp_modules"] == 0 or report.get("param_dtype") != "bfloat16":
        problems.append(
            f"FSDP2 does not shard bf16 parameters at world 1: {report['fsdp_modules']} FSDP modules, "
            f"parameters gathered in {report.get('param_dtype')}"
        )
    pairs = zip(report["losses_after_save"], report["losses_after_load"], strict=True)
    if any(abs(a - b) > 1e-3 * abs(a) for a, b in pairs):
        problems.append("the steps after loading the checkpoint differ from those after saving it")
    return problems


class CollectiveCounter:
    """Calls of torch.distributed's collectives inside the block, by name (the step's own and FSDP2's go through
    these module functions)."""

    NAMES = (
        "all_reduce",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "broadcast",
        "all_to_all_single",
        "all_gather",
        "barrier",
        "all_gather_single",  # torch 2.13's names (runtime's torch_compat picks them where they exist)
        "reduce_scatter_single",
    )

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._originals: dict[tuple[Any, str], Any] = {}

    def __enter__(self) -> CollectiveCounter:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for module in (dist, c10d):
            for name in filter(lambda n: hasattr(module, n), self.NAMES):
                original = getattr(module, name)
                self._originals[module, name] = original
                setattr(module, name, self._counting(name, original))
        return self

    def _counting(self, name: str, original):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return original(*args, **kwargs)

        return counted

    def __exit__(self, *exc: object) -> None:
        for (module, name), original in self._originals.items():
            setattr(module, name, original)


def layouts_agree(ctx) -> dict[str, Any]:
    """The encoders' omni and coupled layouts at world 1 train the same first steps (same losses)."""
    os.environ[ALWAYS_COLLECT_ENV] = "1"
    info, s = join_group(), sizes(ctx.dry_run)
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as root:
        recipe = make_recipe(Path(root), s, s.check_flavor, s.check_seq_len, CHECK_MIX)
        batches = draw_batches(recipe, 2)
        for name in ("dp1", "dp1+omni"):
            replica = build_replica(recipe, ParallelPlan.parse(name), info, CHECK_DTYPE)
            optimizers = Optimizers(replica.parts, recipe)
            losses[name] = [
                one_step(replica, optimizers, b.to(info.device), CHECK_DTYPE).metrics["loss"] for b in batches
            ]
            del replica, optimizers
    coupled, omni = losses["dp1"], losses["dp1+omni"]
    report: dict[str, Any] = {"losses": losses}
    if any(abs(a - b) > 1e-3 * abs(a) for a, b in zip(coupled, omni, strict=True)):
        report.update(status="error", error=f"omni {omni} and coupled {coupled} losses differ at world 1")
    return report


# Activation checkpointing, least recompute first: after running out of memory the model is built again with more.
CHECKPOINTING = ("none", "selective", "full")


class ThroughputModel:
    """omni-1b (debug in a dry run) as a one-GPU job trains it, compiled, built once for both workloads: its
    initialisation on the host takes about a minute (two passes of random draws over 1.7B parameters). Built
    again with more activation checkpointing when a workload runs out of memory (each attempt reported)."""

    def __init__(self, info: DistInfo, s: Sizes) -> None:
        self.info, self.s = info, s
        os.environ.pop(ALWAYS_COLLECT_ENV, None)  # the shortcut a one-GPU job takes
        self.level, self.attempts = 0, []
        self.replica: ModelReplica | None = None
        self.optimizers: Optimizers | None = None
        self.build_s: float | None = None

    @property
    def checkpointing(self) -> str:
        return CHECKPOINTING[self.level]

    def recipe(self, root: Path, workload: str) -> Recipe:
        s = self.s
        return make_recipe(
            root,
            s,
            s.flavor,
            s.seq_len,
            WORKLOADS[workload],
            compile=s.compile,
            activation_checkpointing=self.checkpointing,
        )

    def built(self, recipe: Recipe) -> tuple[ModelReplica, Optimizers]:
        if self.replica is None or self.optimizers is None:
            began = time.perf_counter()
            self.replica = build_replica(recipe, ParallelPlan(), self.info, compute_dtype(self.info))
            self.optimizers = Optimizers(self.replica.parts, recipe)
            self.build_s = time.perf_counter() - began
        return self.replica, self.optimizers

    def escalate(self, workload: str, error: str) -> None:
        """Drop the model that ran out of memory; the next `built` makes one with more checkpointing."""
        self.attempts.append({"workload": workload, "activation_checkpointing": self.checkpointing, "error": error})
        self.replica = self.optimizers = None
        free_device(self.info)
        self.level += 1
        if self.level == len(CHECKPOINTING):
            raise RuntimeError(f"{workload}: out of memory under every activation checkpointing {CHECKPOINTING}")


def workload_throughput(ctx, workload: str, model: ThroughputModel) -> dict[str, Any]:
    while True:
        try:
            return {**timed_run(ctx, model, workload), "attempts": list(model.attempts)}
        except torch.OutOfMemoryError as error:
            message = f"out of memory: {error}"[:300]
        model.escalate(workload, message)  # after the except block, whose traceback held the failed run's tensors


def free_device(info: DistInfo) -> None:
    gc.collect()
    if info.device.type == "cuda":
        torch.cuda.empty_cache()


# Steps whose host syncs are counted, after the timed ones: the counter wraps Tensor methods in Python, which
# the timed steps should not pay for.
SYNC_COUNTED_STEPS = 2


def timed_run(ctx, model: ThroughputModel, workload: str) -> dict[str, Any]:
    """Warm-up steps (compilation), then the timed steps on batches the loader drew beforehand (recompiles
    counted over them), then a few more steps whose host syncs are counted."""
    from gpu_check_measures import count_recompiles, host_sync_counter, step_timer

    info, s = model.info, model.s
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as root:
        recipe = model.recipe(Path(root), workload)
        batches = draw_batches(recipe, s.warmup_steps + s.timed_steps)
    warmup, timed = batches[: s.warmup_steps], batches[s.warmup_steps :]
    replica, optimizers = model.built(recipe)
    dtype = compute_dtype(info)
    for batch in DevicePrefetcher(iter(warmup), info.device):
        one_step(replica, optimizers, batch, dtype)
    if info.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    timer, results = step_timer(info.device), []
    arriving = DevicePrefetcher(iter(timed), info.device)  # as the loader hands the trainer its batches
    with count_recompiles() as recompiles:
        for _ in timed:
            if ctx.left_s() < 10:
                break  # the section's time is nearly up: report the steps timed so far
            with timer:
                results.append(one_step(replica, optimizers, next(arriving), dtype))
    if not results:
        raise RuntimeError(
            f"no step was timed: the section's time ran out in the warm-up (model built in {model.build_s:.0f} s)"
        )
    with host_sync_counter(info.device, optimizers) as syncs:
        for batch in DevicePrefetcher(iter(timed[:SYNC_COUNTED_STEPS]), info.device):
            one_step(replica, optimizers, batch, dtype)
    report = step_figures(results, timer.seconds(), info, dtype, timed)
    report.update(
        flavor=s.flavor,
        seq_len=s.seq_len,
        warmup_steps=s.warmup_steps,
        compile=s.compile,
        activation_checkpointing=model.checkpointing,
        model_build_s=model.build_s,
        attention=recipe.model.attention,
        recompiles_after_warmup=recompiles.count,
        host_syncs_per_step=syncs.per_step(SYNC_COUNTED_STEPS),
        host_syncs=syncs.detail(SYNC_COUNTED_STEPS),
    )
    if not s.compile:
        report["compiled"] = skipped("inductor takes ~20 s a graph on a CPU: the dry run is eager")
    return report


def step_figures(results: list[StepStats], seconds: list[float], info: DistInfo, dtype, batches) -> dict[str, Any]:
    """Tokens/s, MFU against the named peak, peak memory and the workload's token mix over the timed steps."""
    from omni_core.common.tokenizer import IMAGE_ID, PAD_ID

    total_s, tokens, flops = sum(seconds), sum(r.tokens for r in results), sum(r.flops for r in results)
    peak = device_peak(info.device, dtype)
    image = sum(int((b.input_ids == IMAGE_ID).sum()) for b in batches[: len(results)])
    real = sum(int((b.input_ids != PAD_ID).sum()) for b in batches[: len(results)])
    return {
        "steps_timed": len(results),
        "step_s_mean": total_s / max(len(results), 1),
        "step_s": [round(x, 5) for x in seconds],
        "tokens_per_s": tokens / total_s if total_s else None,
        "model_tflops_per_step": flops / max(len(results), 1) / 1e12,
        "mfu_pct": 100 * flops / total_s / peak.flops if peak and total_s else None,
        "peak": peak.name if peak else None,
        "peak_memory_gib": peak_memory_mb(info.device) / 1024,
        "image_to_text_tokens": image / max(real - image, 1),
        "final_loss": results[-1].metrics["loss"],
    }
