"""A tiny recipe, the one CPU process and a tracker that keeps what the trainer logs: the runtime tests share them
(in one process, and against an S3 server)."""

from __future__ import annotations

from pathlib import Path

import torch

from omni_core.recipe.schema import Recipe
from omni_core.runtime.dist import DistInfo
from omni_core.tracking import NullTracker

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def tiny_recipe(root: Path, **train_overrides) -> Recipe:
    train_cfg = {"steps": 6, "lr": 3e-3, "warmup_steps": 2, "log_every": 1, "ckpt_every": 0}
    train_cfg.update(train_overrides)
    return Recipe.model_validate({
        "experiment": {"name": "tiny", "output_dir": str(root / "out"), "seed": 3},
        "data": {"path": str(root / "data"), "synthetic": {"num_samples": 80}, "seq_len": 256},
        "train": train_cfg,
        "eval": {"max_batches": 2},
    })


class RecordingTracker(NullTracker):
    """Keeps what the trainer logs, so tests can read per-step losses."""

    def __init__(self) -> None:
        self.metrics: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics, step=None):  # noqa: D102 - protocol method
        self.metrics.setdefault(step, {}).update(metrics)
