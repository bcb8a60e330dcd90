"""Training a plan on gloo ranks against one process: the shared harness of the multi-rank plan tests.

For each plan the ranks take a few optimizer steps through the real `train_step`; the reference is one
process doing gradient accumulation over the same micro-batches (all data-parallel shards). Losses per step
and the full gradients of the last step (after two optimizer updates, so the weights agree too) must agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from omni_core.common.plan import ParallelPlan
from omni_core.data.balance import balance_for
from omni_core.data.dataset import open_dataset
from omni_core.data.loader import PackedLoader
from omni_core.data.synthetic import ensure_dataset
from omni_core.recipe.schema import Recipe
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.ranks import run_ranks
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.replica import build_replica
from omni_core.runtime.step import train_step
from tests.helpers.recipes import build_recipe

STEPS = 3
GRAD_ACCUM = 2


# the plans' recipe, as overrides of tests.helpers.recipes' base (model.flavor added per plan): every plan and its
# one-process reference read one dataset, in float32 so that they agree to rounding
PLANS = {"experiment.name": "par", "experiment.seed": 5, "data.synthetic.num_samples": 120, "train.steps": 10,
         "train.warmup_steps": 1, "train.grad_accum": GRAD_ACCUM, "train.dtype": "float32"}


class CapturingOptimizers(Optimizers):
    """Optimizers that keep the full (gathered) gradients they were about to apply (frozen parameters have none):
    under a ZeRO stage those of the slices they step."""

    def __init__(self, parts, recipe):
        super().__init__(parts, recipe)
        self.parts, self.grads = parts, {}

    def step(self) -> None:
        self.grads = {}
        for part, shards in zip(self.parts, self.zero, strict=True):
            for name, param in shards.named_shards() if shards is not None else part.named_parameters():
                grad = param.grad
                if grad is None:
                    continue
                self.grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
        super().step()


def loaders_for(recipe: Recipe, shards: list[int], num_shards: int, balanced: bool = False) -> list:
    """The shards' training loaders: each packing its own stream, or `balanced` as the recipe says (one node:
    a group of all shards)."""
    dataset = open_dataset(recipe)
    return [iter(PackedLoader(dataset, recipe.data, "train", r, num_shards, recipe.experiment.seed,
                              balance_for(recipe, r, num_shards, num_shards) if balanced else None)) for r in shards]


def steps(replica, optimizers, loaders, count: int, metrics: list | None = None) -> list[float]:
    """Losses of `count` steps; each step's metrics are appended to `metrics` when given."""
    losses = []
    for _ in range(count):
        batches = [next(loader) for loader in loaders for _ in range(GRAD_ACCUM)]
        step_metrics = train_step(replica, optimizers, batches, grad_clip=1.0).metrics
        losses.append(step_metrics["loss"])
        if metrics is not None:
            metrics.append(step_metrics)
    return losses


def run_plan(recipe: Recipe, plan: ParallelPlan, info: DistInfo, shards: list[int], balanced: bool = False
             ) -> tuple[list[float], dict, list[dict]]:
    """Losses of STEPS steps of `plan` on the given data shards, the full gradients of the last step, and
    every step's metrics."""
    replica = build_replica(recipe, plan, info, torch.float32)
    optimizers = CapturingOptimizers(replica.parts, recipe)
    metrics: list[dict] = []
    loaders = loaders_for(recipe, shards, max(plan.dp, len(shards)), balanced) if replica.loads_data else []
    losses = steps(replica, optimizers, loaders, STEPS, metrics)
    return losses, optimizers.grads, metrics


def plans_worker(rank: int, world: int, root: str, flavors_and_plans: list[tuple[str, str]], balanced: bool) -> dict:
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    results = {}
    for flavor, name in flavors_and_plans:
        plan = ParallelPlan.parse(name)
        recipe = build_recipe(root, {**PLANS, "model.flavor": flavor})
        results[flavor, name] = run_plan(recipe, plan, info, [plan.data_rank(rank)], balanced)
    return results


def reference(root: Path, flavor: str, dp: int, balanced: bool = False) -> tuple[list[float], dict, list[dict]]:
    """One process, gradient accumulation over all `dp` data shards' micro-batches."""
    cpu = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    recipe = build_recipe(root, {**PLANS, "model.flavor": flavor})
    return run_plan(recipe, ParallelPlan(), cpu, list(range(dp)), balanced)


def check_plans(root: Path, world: int, flavors_and_plans: list[tuple[str, str]], balanced: bool = False
                ) -> dict[tuple, list[dict]]:
    """Asserts each plan trains like one process; returns rank 0's step metrics per (flavor, plan). `balanced`:
    the loaders balance as the recipe's `data.balance` says (its default, grouped), else each packs its own."""
    ensure_dataset(build_recipe(root, PLANS))
    per_rank = run_ranks(plans_worker, world, str(root), flavors_and_plans, balanced)
    references: dict[tuple[str, int], tuple] = {}  # plans of one flavor and data degree share their reference
    for flavor, name in flavors_and_plans:
        plan = ParallelPlan.parse(name)
        if (flavor, plan.dp) not in references:
            references[flavor, plan.dp] = reference(root, flavor, plan.dp, balanced)
        ref_losses, ref_grads, _ = references[flavor, plan.dp]
        merged: dict[str, torch.Tensor] = {}
        for rank_results in per_rank:
            losses, grads, _ = rank_results[flavor, name]
            assert losses == pytest.approx(ref_losses, rel=1e-5), f"{flavor} {name}: losses"
            merged.update(grads)
        assert merged.keys() == ref_grads.keys(), f"{flavor} {name}: parameter names"
        for key, expected in ref_grads.items():
            torch.testing.assert_close(merged[key], expected, rtol=1e-3, atol=1e-6, msg=f"{flavor} {name}: {key}")
    return {key: metrics for key, (_, _, metrics) in per_rank[0].items()}


