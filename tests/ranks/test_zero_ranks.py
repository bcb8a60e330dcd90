"""ZeRO-1, ZeRO-2 and replicated data parallelism on gloo ranks: each trains like one process, shards the
optimizer states and gradients as named, issues the collectives the estimator prices, and checkpoints through
DCP (resuming under FSDP and back)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omni_core.common.catalog import GpuCatalog
from omni_core.common.plan import ParallelPlan
from omni_core.data.synthetic import ensure_dataset
from omni_core.estimator.cost import Efficiency, Options
from omni_core.estimator.memory import param_state_bytes
from omni_core.estimator.recipe_cells import flavor_workload
from omni_core.estimator.stage import SHARDING_COLLECTIVES
from omni_core.estimator.terms import PlanTerms
from omni_core.parallel.zero import zero_shards
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.gradients import finish_gradients
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.ranks import run_ranks
from omni_core.runtime.replica import build_replica
from tests.helpers.collective_devices import check_collective_devices
from tests.helpers.plans import GRAD_ACCUM, PLANS, check_plans, loaders_for, steps
from tests.helpers.recipes import build_recipe
from tests.ranks.test_parallel_ranks import _resume_worker

STAGES = ("dp2z0", "dp2z1", "dp2z2")
KINDS = {"allreduce": "all_reduce", "reduce_scatter": "reduce_scatter", "allgather": "all_gather"}


def test_zero_stages_on_two_ranks_train_like_one_process(tmp_path):
    check_plans(tmp_path, 2, [("debug", name) for name in STAGES])


def test_zero_stages_compose_with_tp_pp_cp_and_replicas_like_one_process(tmp_path):
    """TP-sharded parameters are cut along their other dimension; pipeline chunks each keep their own slices;
    CP ranks are shard ranks (as under FSDP); dp_replicate copies the shards."""
    check_plans(
        tmp_path,
        4,
        [
            ("debug", "dp2z1-tp2"),
            ("debug", "dp2z2-tp2"),
            ("debug", "dp2z2-pp2"),
            ("debug", "dp1z1-pp2v2-cp2u"),
            ("debug", "dp2z2-cp2r"),
            ("debug", "dp2x2z1"),
            ("debug", "dp2x2z2"),
        ],
    )


class _Collectives(TorchDispatchMode):
    """Every c10d collective of a block: (kind, elements of its largest tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
            kind = next((k for key, k in KINDS.items() if key in func.__name__), func.__name__)
            self.seen.append((kind, max((t.numel() for t in tensors), default=0)))
        return func(*args, **(kwargs or {}))


def _stage_worker(rank: int, world: int, root: str) -> dict:
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    recipe = build_recipe(root, {**PLANS, "model.flavor": "debug"})
    out = {}
    for name in STAGES:
        plan = ParallelPlan.parse(name)
        replica = build_replica(recipe, plan, info, torch.float32)
        optimizers = Optimizers(replica.parts, recipe)
        steps(replica, optimizers, loaders_for(recipe, [plan.data_rank(rank)], plan.dp), 1)
        params = sum(p.numel() for p in replica.trainable())
        states = sum(
            s.to_local().numel()
            for opt in optimizers.optimizers
            for state in opt.state.values()
            for key, s in state.items()
            if key != "step"
        )
        loader = loaders_for(recipe, [plan.data_rank(rank)], plan.dp)[0]
        for batch in [next(loader) for _ in range(GRAD_ACCUM)]:  # a backward whose gradients are kept
            replica.parts[0](batch).sum().backward()
        recorder = _Collectives()
        with check_collective_devices() as record, recorder:
            finish_gradients(replica)
        shards = zero_shards(replica.parts[0])
        assert shards is not None
        kept = sum(p.grad.numel() for p in replica.trainable() if p.grad is not None)
        kept_slices = sum(s.grad.to_local().numel() for _, s in shards.named_shards() if s.grad is not None)
        with recorder:
            optimizers.step()
        out[name] = {
            "params": params,
            "states": states,
            "whole_grads": kept,
            "slice_grads": kept_slices,
            "collectives": recorder.seen,
            "on_host": record.on_host,
        }
        replica.meshes.release()
    return out


def test_each_stage_shards_what_it_names_and_issues_the_collectives_the_estimator_prices(tmp_path):
    """ZeRO-1 halves the optimizer states on two ranks, ZeRO-2 the gradients too (the whole ones are freed),
    replicated DP neither; the step's large collectives are the kinds `estimator.stage.SHARDING_COLLECTIVES`
    prices per stage, each moving the rank's parameters (all-gather, all-reduce) or their ranks' padded
    chunks (reduce-scatter), all on the compute device."""
    ensure_dataset(build_recipe(tmp_path, PLANS))
    for out in run_ranks(_stage_worker, 2, str(tmp_path)):
        params = out["dp2z0"]["params"]
        assert out["dp2z0"]["states"] == 2 * params
        for name in ("dp2z1", "dp2z2"):
            assert out[name]["states"] == pytest.approx(params, rel=0.02), f"{name}: half of AdamW's two states"
        assert out["dp2z1"]["whole_grads"] == params and out["dp2z0"]["whole_grads"] == params
        assert out["dp2z2"]["whole_grads"] < 0.02 * params, "ZeRO-2 keeps only whole gradients of vectors"
        assert out["dp2z2"]["slice_grads"] == pytest.approx(params / 2, rel=0.02)
        for name, stage in zip(STAGES, ("replicate", "zero1", "zero2"), strict=True):
            large = [(kind, n) for kind, n in out[name]["collectives"] if n >= params / 2]
            assert sorted({kind for kind, _ in large}) == sorted(kind for kind, _ in SHARDING_COLLECTIVES[stage])
            assert all(n == pytest.approx(params, rel=0.02) for _, n in large), f"{name}: {large}"
            assert not out[name]["on_host"]
    # the estimator's model states per parameter are what the runtime held at its peak (fp32 here): whole
    # weights, whole gradients until the reduction after the backward, and the stage's optimizer states
    workload = flavor_workload(build_recipe(tmp_path, PLANS), "debug", 2, precision="fp32")
    for name in STAGES:
        terms = PlanTerms.of(workload, GpuCatalog()["a100-80gb"], ParallelPlan.parse(name), Options(), Efficiency(), 2)
        held = 4 * (2 * out[name]["params"] + out[name]["states"]) / out[name]["params"]
        assert held == pytest.approx(param_state_bytes(terms, 2), rel=0.02), name


@pytest.mark.parametrize("saved,resumed", [("dp4z1", "dp2-tp2"), ("dp2-pp2", "dp2z2-tp2"), ("dp2z2-tp2", "dp2x2z1")])
def test_a_zero_checkpoint_resumes_under_another_plan(tmp_path, saved, resumed):
    """The optimizer's slices are saved as DTensors of their parameters' shapes: DCP reshards them into FSDP's
    shards, TP's, or another stage's slices, and the next step's loss is the one training on would give."""
    ensure_dataset(build_recipe(tmp_path, PLANS))
    for continued, after_resume in run_ranks(_resume_worker, 4, str(tmp_path), saved, resumed):
        assert after_resume == pytest.approx(continued, rel=1e-5)
