"""bf16 parameters on plans whose data-parallel degree is 1 (FSDP2 on a 1-rank mesh beside TP or PP), with
selective activation checkpointing under TP: the blocks compute with bf16 weights, the optimizer steps fp32
ones, and the losses are those of one fp32 process to bf16's precision."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from omni_core.common.plan import ParallelPlan
from omni_core.data.synthetic import ensure_dataset
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.ranks import run_ranks
from omni_core.runtime.replica import build_replica
from omni_core.runtime.step import train_step
from tests.helpers.plans import GRAD_ACCUM, PLANS, STEPS, loaders_for, reference
from tests.helpers.recipes import build_recipe

CASES = [("dp1-tp2", "selective"), ("dp1-pp2", "none")]


def _bf16_worker(rank: int, world: int, root: str) -> dict[str, tuple[list[float], set, set]]:
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    results = {}
    for name, checkpointing in CASES:
        bf16 = {"model.flavor": "debug", "train.dtype": "bfloat16", "train.activation_checkpointing": checkpointing}
        recipe = build_recipe(root, {**PLANS, **bf16})
        plan = ParallelPlan.parse(name)
        replica = build_replica(recipe, plan, info, torch.bfloat16)
        seen: set[torch.dtype] = set()
        for part in replica.parts:
            for module_name, module in part.named_modules():
                if module_name.endswith("attention.wq"):
                    module.register_forward_pre_hook(lambda m, args, seen=seen: seen.add(m.weight.dtype))
        optimizers = Optimizers(replica.parts, recipe)
        loader = loaders_for(recipe, [plan.data_rank(rank)], plan.dp)[0]
        losses = []
        for _ in range(STEPS):
            batches = [next(loader) for _ in range(GRAD_ACCUM)]
            stats = train_step(replica, optimizers, batches, grad_clip=1.0, compute_dtype=torch.bfloat16)
            losses.append(stats.metrics["loss"])
        masters = {(type(p) is DTensor, p.dtype) for part in replica.parts for p in part.parameters()}
        results[name] = (losses, seen, masters)
        assert replica.meshes is not None
        replica.meshes.release()
    return results


def test_bf16_weights_in_forward_and_fp32_parameters_beside_tp_and_pp(tmp_path):
    ensure_dataset(build_recipe(tmp_path, PLANS))
    per_rank = run_ranks(_bf16_worker, 2, str(tmp_path))
    fp32_losses, _, _ = reference(tmp_path, "debug", 1)
    for name, _ in CASES:
        for losses, seen, masters in (rank_results[name] for rank_results in per_rank):
            assert seen == {torch.bfloat16}, name
            assert masters == {(True, torch.float32)}, name
            assert losses == pytest.approx(fp32_losses, rel=0.02), name
