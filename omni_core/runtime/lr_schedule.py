"""The learning-rate schedule: linear warm-up, then cosine decay to a floor. Its own module because the optimizers
(`runtime.optimizer`) build it per model part and the tests check its shape without building a model."""

from __future__ import annotations

import math

import torch


def lr_lambda(step: int, *, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up, then cosine decay to `floor` (a share of the peak lr) at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup: int, total: int, floor: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """`optimizer`'s schedule: every group's lr is its base lr times `lr_lambda` of the step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, warmup=warmup, total=total, floor=floor))
