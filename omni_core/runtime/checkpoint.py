"""Checkpoints with torch.distributed.checkpoint (DCP) and a JSON manifest written last.

A step holds the DCP shards (model + optimizer), one `rank<r>.pt` per rank with what is private to a rank
(data-loader position, RNG), and `manifest.json`. Model and optimizer state are keyed by the whole model's
parameter names (optimizer state flattened, one entry per parameter), whatever the plan that saved them:
DCP reshards them on load, so a run saved under one plan resumes under another (e.g. dp4 -> dp2-tp2). The
manifest is written only after every rank's files are durable in the store (ckpt_store: a local directory or
S3), so a step without it is an interrupted save and is never taken for a checkpoint.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from omni_core.recipe.schema import Recipe
from omni_core.runtime.ckpt_store import (
    MANIFEST,
    CheckpointError,
    CheckpointStore,
    checkpoint_cache,
    open_store,
    split_location,
)
from omni_core.runtime.dist import DistInfo, barrier

if TYPE_CHECKING:
    from omni_core.runtime.optimizer import Optimizers

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


def local_manifest(recipe: Recipe, location: str) -> Path:
    """This machine's copy of a saved checkpoint's manifest (S3 stores keep one in the staging cache)."""
    root, step = split_location(location)
    return open_store(root, checkpoint_cache(recipe)).local_dir(step) / MANIFEST


def latest_checkpoint(store: CheckpointStore) -> str | None:
    """Location of the newest complete checkpoint in the store, or None."""
    steps = store.steps()
    return store.location(steps[-1]) if steps else None


OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(parts: Sequence[nn.Module], optimizers: Optimizers | None) -> dict[str, dict[str, Any]]:
    """{"model": ..., "optim": ...} over all model parts, keyed by the whole model's names (the optimizer's
    through the module it steps: the part, or a ZeRO stage's slices, `Optimizers.stepped_module`)."""
    model_state: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    for index, part in enumerate(parts):
        model_state.update(get_model_state_dict(part, options=OPTIONS))
        if optimizers is not None:
            stepped = optimizers.stepped_module(index, part)
            optim_state.update(get_optimizer_state_dict(stepped, optimizers.optimizers[index], options=OPTIONS))
    return {"model": model_state, "optim": optim_state} if optimizers is not None else {"model": model_state}


def save_checkpoint(
    store: CheckpointStore,
    *,
    step: int,
    parts: Sequence[nn.Module],
    optimizers: Optimizers,
    rank_state: dict[str, Any],
    history: dict[str, Any],
    info: DistInfo,
    plan: str,
    recipe_hash: str,
    keep_last: int,
) -> str:
    """Save collectively; returns the checkpoint's location once it is complete on every rank."""
    target = store.local_dir(step)
    if info.local_rank == 0:  # each node's leader: a shared folder sees several, so both calls tolerate each other
        shutil.rmtree(target, ignore_errors=True)  # leftovers of an interrupted save of this step
        target.mkdir(parents=True, exist_ok=True)
    barrier()
    dcp.save(_state(parts, optimizers), checkpoint_id=str(target))
    torch.save(rank_state, target / f"rank{info.rank}.pt")
    store.publish(step, info.rank)
    barrier()
    if info.is_main:
        manifest = Manifest(
            step, info.world_size, plan, recipe_hash, optimizers.scheduler_state(), history, time.time()
        )
        store.write_manifest(step, asdict(manifest))
        for old in _superseded(store.steps(), step, keep_last):
            store.delete(old)
    barrier()
    return store.location(step)


def _superseded(steps: list[int], saved: int, keep_last: int) -> list[int]:
    """Steps to delete after saving `saved`: past the newest `keep_last` up to it, and every later one, which
    an earlier run left (this run restarted with `train.resume=false`) and a resume must never take for its own."""
    own = [s for s in steps if s <= saved]
    return own[:-keep_last] + [s for s in steps if s > saved]


def load_checkpoint(
    location: str,
    *,
    cache: Path,
    parts: Sequence[nn.Module],
    optimizers: Optimizers | None,
    info: DistInfo,
    plan: str | None = None,
    data_shard: list[int] | None = None,
) -> tuple[Manifest, dict[str, Any] | None]:
    """Restore the model parts (+ optimizers and LR schedule when given) in place from a complete checkpoint.

    Returns the manifest and this rank's private state (data position, RNG), read as plain tensors and
    containers only (`weights_only`: a planted rank file cannot run code). Under another plan on the same
    world that is the state of a rank that read the same `data_shard` ([data rank, dp]), so a re-planned job
    keeps its data order; None when no rank did (the data order restarts).
    """
    ckpt = _fetched(location, cache, info)
    manifest = Manifest.read(ckpt)
    state = _state(parts, optimizers)
    dcp.load(state, checkpoint_id=str(ckpt))
    for index, part in enumerate(parts):
        names = set(get_model_state_dict(part, options=OPTIONS))
        model_state = {k: v for k, v in state["model"].items() if k in names}
        set_model_state_dict(part, model_state, options=OPTIONS)
        if optimizers is not None:
            stepped = optimizers.stepped_module(index, part)
            set_optimizer_state_dict(stepped, optimizers.optimizers[index], state["optim"], options=OPTIONS)
    if optimizers is not None:
        optimizers.load_scheduler_state(manifest.scheduler)
    rank_file = ckpt / f"rank{info.rank}.pt"
    if manifest.world_size != info.world_size or not rank_file.is_file():
        return manifest, None
    if plan is None or manifest.plan == plan:
        return manifest, torch.load(rank_file, weights_only=True)
    if data_shard is None:
        return manifest, None
    for rank in range(info.world_size):
        state = torch.load(ckpt / f"rank{rank}.pt", weights_only=True)
        if state.get("data_shard") == data_shard:
            return manifest, state
    return manifest, None


def _fetched(location: str, cache: Path, info: DistInfo) -> Path:
    """The local folder of a checkpoint step (an S3 one downloaded once per machine into `cache`)."""
    root, step = split_location(location)
    store = open_store(root, cache)
    if info.local_rank == 0:
        store.fetch(step)
    barrier()
    return store.local_dir(step)


def init_location(recipe: Recipe, info: DistInfo) -> str:
    """The checkpoint `model.init_from` names (`weights_location`)."""
    assert recipe.model.init_from is not None
    return weights_location(recipe.model.init_from, recipe, info, "model.init_from")


def weights_location(source: str, recipe: Recipe, info: DistInfo, field: str) -> str:
    """The checkpoint `source` names: a step folder (a local folder holding a manifest, such as a registered
    checkpoint downloaded from MLflow, or …/step_NNNNNN, local or S3), a checkpoint folder's newest complete
    step, or models:/NAME@ALIAS. Raises CheckpointError naming `field` when it holds none."""
    cache = checkpoint_cache(recipe)
    if source.startswith("models:/"):
        from omni_core.tracking import resolve_tracking_uri
        from omni_core.tracking.models import registered_checkpoint

        uri = resolve_tracking_uri(recipe)
        if info.local_rank == 0:
            registered_checkpoint(source, uri, cache / "init_from", download=True)
        barrier()
        source = registered_checkpoint(source, uri, cache / "init_from", download=False)
    if (Path(source) / MANIFEST).is_file():
        return source
    try:
        split_location(source)
        return source
    except CheckpointError:
        newest = latest_checkpoint(open_store(source, cache))
    if newest is None:
        raise CheckpointError(f"{field}: {source} holds no complete checkpoint (a step with {MANIFEST})")
    return newest


def load_weights(location: str, *, cache: Path, parts: Sequence[nn.Module], info: DistInfo) -> Manifest:
    """Only the model's weights from a checkpoint saved under any plan (DCP reshards them): no optimizer
    state, step, schedule or data position. How a stage starts from another (`model.init_from`)."""
    ckpt = Path(location) if (Path(location) / MANIFEST).is_file() else _fetched(location, cache, info)
    manifest = Manifest.read(ckpt)
    state = _state(parts, None)
    dcp.load(state, checkpoint_id=str(ckpt))
    for part in parts:
        names = set(get_model_state_dict(part, options=OPTIONS))
        set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in names}, options=OPTIONS)
    return manifest
