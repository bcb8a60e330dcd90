"""Checkpoints with torch.distributed.checkpoint (DCP) and a JSON manifest written last.

Layout: <ckpt_dir>/step_000050/ holds the DCP shards (model + optimizer), one `rank<r>.pt` per rank with
what is private to a rank (data-loader position, RNG), and `manifest.json`. The manifest is written only
after every rank has finished writing, so a directory without it is an interrupted save and is never
taken for a checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from omni_core.runtime.dist import DistInfo, barrier

MANIFEST = "manifest.json"
# Evaluation and single-process tests use DCP without a process group on purpose; DCP warns about it each time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


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
        return cls(**json.loads((ckpt / MANIFEST).read_text()))


def step_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step_{step:06d}"


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints (those with a manifest), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = complete_checkpoints(ckpt_dir)
    return found[-1] if found else None


def save_checkpoint(
    ckpt_dir: Path,
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
) -> Path:
    target = step_dir(ckpt_dir, step)
    if info.is_main:
        shutil.rmtree(target, ignore_errors=True)  # leftovers of an interrupted save of this step
        target.mkdir(parents=True)
    barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(target))
    torch.save(rank_state, target / f"rank{info.rank}.pt")
    barrier()
    if info.is_main:
        manifest = Manifest(
            step, info.world_size, plan, recipe_hash, scheduler.state_dict(), history, time.time()
        )
        tmp = target / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest.__dict__, indent=2))
        tmp.replace(target / MANIFEST)
        for old in complete_checkpoints(ckpt_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return target


def load_checkpoint(
    ckpt: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    info: DistInfo,
) -> tuple[Manifest, dict[str, Any] | None]:
    """Restore model (+ optimizer and LR schedule when given) in place.

    Returns the manifest and this rank's private state, or None for the latter when the checkpoint was
    written by a different world size (rank-private state such as the data position does not carry over).
    """
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
