"""Checkpoints with torch.distributed.checkpoint (DCP) and a JSON manifest written last.

A step holds the DCP shards (model + optimizer), one `rank<r>.pt` per rank with what is private to a rank
(data-loader position, RNG), and `manifest.json`. The manifest is written only after every rank's files
are durable in the store (ckpt_store: a local directory or S3), so a step without it is an interrupted save
and is never taken for a checkpoint.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from omni_core.recipe.schema import Recipe
from omni_core.runtime.ckpt_store import MANIFEST, CheckpointError, CheckpointStore, open_store, split_location
from omni_core.runtime.dist import DistInfo, barrier

# Evaluation and single-process tests use DCP without a process group on purpose; DCP warns about it each time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclass
class Manifest:
    step: int
    world_size: int
    plan: str
    recipe_hash: str
    scheduler: dict[str, Any]
    history: dict[str, Any]  # loss and throughput so far, so a resumed or finished run reports the whole run
    saved_at: float

    @classmethod
    def read(cls, ckpt: Path) -> Manifest:
        path = ckpt / MANIFEST
        if not path.is_file():
            raise CheckpointError(f"{ckpt} has no {MANIFEST}: an incomplete save, refusing to load it")
        return cls(**json.loads(path.read_text()))


def checkpoint_store(recipe: Recipe) -> CheckpointStore:
    """The recipe's store; S3 checkpoints are staged and cached under the experiment's output directory."""
    return open_store(recipe.checkpoint_dir(), checkpoint_cache(recipe))


def checkpoint_cache(recipe: Recipe) -> Path:
    return Path(recipe.experiment.output_dir) / recipe.experiment.name / f"ckpt-cache-{recipe.training_hash()}"


def local_manifest(recipe: Recipe, location: str) -> Path:
    """This machine's copy of a saved checkpoint's manifest (S3 stores keep one in the staging cache)."""
    root, step = split_location(location)
    return open_store(root, checkpoint_cache(recipe)).local_dir(step) / MANIFEST


def latest_checkpoint(store: CheckpointStore) -> str | None:
    """Location of the newest complete checkpoint in the store, or None."""
    steps = store.steps()
    return store.location(steps[-1]) if steps else None


def save_checkpoint(
    store: CheckpointStore,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rank_state: dict[str, Any],
    history: dict[str, Any],
    info: DistInfo,
    plan: str,
    recipe_hash: str,
    keep_last: int,
) -> str:
    """Save collectively; returns the checkpoint's location once it is complete on every rank."""
    target = store.local_dir(step)
    if info.local_rank == 0:
        shutil.rmtree(target, ignore_errors=True)  # leftovers of an interrupted save of this step
        target.mkdir(parents=True)
    barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(target))
    torch.save(rank_state, target / f"rank{info.rank}.pt")
    store.publish(step, info.rank)
    barrier()
    if info.is_main:
        manifest = Manifest(step, info.world_size, plan, recipe_hash, scheduler.state_dict(), history, time.time())
        store.write_manifest(step, asdict(manifest))
        for old in store.steps()[:-keep_last]:
            store.delete(old)
    barrier()
    return store.location(step)


def load_checkpoint(
    location: str,
    *,
    cache: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    info: DistInfo,
) -> tuple[Manifest, dict[str, Any] | None]:
    """Restore model (+ optimizer and LR schedule when given) in place from a complete checkpoint.

    Returns the manifest and this rank's private state, or None for the latter when the checkpoint was
    written by a different world size (rank-private state such as the data position does not carry over).
    """
    root, step = split_location(location)
    store = open_store(root, cache)
    if info.local_rank == 0:
        store.fetch(step)
    barrier()
    ckpt = store.local_dir(step)
    manifest = Manifest.read(ckpt)
    if optimizer is None:
        model_state = get_state_dict(model, [])[0]
        dcp.load({"model": model_state}, checkpoint_id=str(ckpt))
        set_state_dict(model, [], model_state_dict=model_state, optim_state_dict={})
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(ckpt))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if scheduler is not None:
        scheduler.load_state_dict(manifest.scheduler)
    rank_file = ckpt / f"rank{info.rank}.pt"
    if manifest.world_size != info.world_size or not rank_file.is_file():
        return manifest, None
    return manifest, torch.load(rank_file, weights_only=False)
