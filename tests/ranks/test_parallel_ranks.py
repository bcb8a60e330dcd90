"""5D parallelism on gloo: every plan trains like one process.

Each launch forks a small world and runs several plans one after another (a launch costs ~1 s per rank on
2 cores). For each plan the ranks take a few optimizer steps through the real `train_step`; the reference
is one process doing gradient accumulation over the same micro-batches (all data-parallel shards). Losses
per step and the full gradients of the last step (after two optimizer updates, so the weights agree too)
must agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from omni_core.common.plan import ParallelPlan
from omni_core.data.synthetic import ensure_dataset
from omni_core.runtime.checkpoint import load_checkpoint, save_checkpoint
from omni_core.runtime.ckpt_store import LocalStore
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.ranks import run_ranks
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.replica import build_replica
from tests.helpers.plans import GRAD_ACCUM, PLANS, check_plans, loaders_for, steps
from tests.helpers.recipes import build_recipe

def test_plans_on_two_ranks_train_like_one_process(tmp_path):
    check_plans(tmp_path, 2, [
        ("debug", "dp2"),
        ("debug", "dp1-tp2"),
        ("debug", "dp1-cp2u"),
        ("debug", "dp1-cp2r"),
        ("debug", "dp1-pp2"),
        ("debug", "dp1-pp2v2"),
        ("debug", "dp1-pp2g"),
        ("debug-moe", "dp2-ep2"),
        ("debug-moe", "dp1-tp2"),
    ])


def test_plans_on_four_ranks_train_like_one_process(tmp_path):
    """Data parallelism beside each other degree; dp2 x TP and dp2 x PP train against one process with omni
    encoders (test_encoder_layouts_ranks) and together in the eight-rank test."""
    check_plans(tmp_path, 4, [
        ("debug", "dp2x2"),
        ("debug", "dp2-cp2r"),
        ("debug", "dp1-tp2-cp2u"),
        ("debug-moe", "dp2-cp2u-ep2"),
        ("debug-moe", "dp2-tp2-ep2"),
        ("debug-moe", "dp2-pp2v2-ep2"),
    ])


def test_dp_tp_pp_on_eight_ranks_trains_like_one_process(tmp_path):
    check_plans(tmp_path, 8, [("debug", "dp2-tp2-pp2")])


def test_all_five_dimensions_at_once_train_like_one_process(tmp_path):
    """The smallest world with every degree at 2: 16 ranks, EP folded into dp x cp as torchtitan does."""
    check_plans(tmp_path, 16, [("debug-moe", "dp2-tp2-pp2-cp2u-ep2")])


def _resume_worker(rank: int, world: int, root: str, saved: str, resumed: str) -> tuple[float, float]:
    """Train one step under `saved` and checkpoint; then the next step's loss continuing under `saved`,
    and under `resumed` after loading the checkpoint. Both see the same global micro-batches: the data is
    split into world shards and each data rank of a plan takes world / dp of them."""
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    recipe = build_recipe(root, PLANS)
    store = LocalStore(Path(root) / "ckpt")
    losses = {}
    for name in (saved, resumed):
        plan = ParallelPlan.parse(name)
        per_rank = world // plan.dp
        shards = [plan.data_rank(rank) * per_rank + i for i in range(per_rank)]
        recipe.train.grad_accum = per_rank * GRAD_ACCUM  # the pipeline schedule's micro-batch count
        replica = build_replica(recipe, plan, info, torch.float32)
        optimizers = Optimizers(replica.parts, recipe)
        loaders = loaders_for(recipe, shards, world) if replica.loads_data else []
        if name == saved:
            steps(replica, optimizers, loaders, 1)
            save_checkpoint(store, step=1, parts=replica.parts, optimizers=optimizers, rank_state={}, history={},
                            info=info, plan=name, recipe_hash="test", keep_last=1)
        else:
            load_checkpoint(store.location(1), cache=Path(root) / "cache", parts=replica.parts,
                            optimizers=optimizers, info=info, plan=name)
            for loader in loaders:  # the batches of step 1, already trained
                for _ in range(GRAD_ACCUM):
                    next(loader)
        losses[name] = steps(replica, optimizers, loaders, 1)[0]
    return losses[saved], losses[resumed]


# each pair reshards the LLM across kinds (FSDP -> TP, TP -> PP, PP -> CP) while its encoders change layout, so
# a plain LLM pair (dp4 -> dp2-tp2, dp2-tp2 -> dp2-pp2) would repeat a reshard another pair already does
@pytest.mark.parametrize("saved,resumed", [("dp2-pp2", "dp1-tp2-cp2r"),
                                          ("dp2-tp2", "dp2-pp2+omni"), ("dp4+omni.v-sp2-t16", "dp1-tp2-cp2r"),
                                          ("dp2-tp2+omni", "dp1-tp2+disagg2"),
                                          ("dp4+omni.v-fsdp.a-fsdp", "dp1-tp2+disagg2.v-fsdp"),
                                          ("dp1-tp2+disagg2.v-fsdp", "dp2-tp2+omni")])
def test_checkpoint_saved_under_one_plan_resumes_under_another(tmp_path, saved, resumed):
    ensure_dataset(build_recipe(tmp_path, PLANS))
    for continued, after_resume in run_ranks(_resume_worker, 4, str(tmp_path), saved, resumed):
        assert after_resume == pytest.approx(continued, rel=1e-5)


def _partial_grads_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, distribute_tensor

    from omni_core.runtime.gradients import replicate_partial_grads

    mesh = init_device_mesh("cpu", (world,))
    norms = [torch.nn.Parameter(distribute_tensor(torch.zeros(n), mesh, [Replicate()])) for n in (3, 5)]
    for param in norms:
        param.grad = DTensor.from_local(torch.full(param.shape, rank + 1.0), mesh, [Partial()], run_check=False)
    averaged = torch.nn.Parameter(distribute_tensor(torch.zeros(2), mesh, [Replicate()]))
    averaged.grad = DTensor.from_local(torch.full((2,), rank + 1.0), mesh, [Partial("avg")], run_check=False)
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
    sharded.grad = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    calls = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda tensor, *args, **kwargs: calls.append(tensor.numel()) or all_reduce(tensor, *args, **kwargs)
    try:
        replicate_partial_grads([*norms, averaged, sharded])
    finally:
        dist.all_reduce = all_reduce
    return {"calls": calls, "placements": [p.grad.placements for p in (*norms, averaged, sharded)],
            "local": [p.grad.to_local().tolist() for p in (*norms, averaged, sharded)]}


def test_partial_gradients_are_summed_once_per_group_and_become_replicated():
    """TP leaves the norms' gradients partial; summed by one flat all-reduce per placement group, they are what
    every later operator (norm, AdamW) would have reduced them to, without a collective per operator."""
    for out in run_ranks(_partial_grads_worker, 2):
        assert sorted(out["calls"]) == [2, 8], "one all-reduce per group: the two sums together, the average"
        assert out["placements"][:3] == [(Replicate(),)] * 3
        assert out["placements"][3] == (Shard(0),)
        assert out["local"][:3] == [[3.0] * 3, [3.0] * 5, [1.5] * 2]
        assert out["local"][3] == [1.0, 1.0]


def _gloo_threads() -> int:
    from collections import Counter

    tasks = Path("/proc/self/task")
    return Counter((task / "comm").read_text().strip() for task in tasks.iterdir())["gloo_tcp_loop"]


def _runs_worker(rank: int, world: int, root: str) -> dict:
    import gc

    import torch.distributed as dist

    from omni_core.models.omni import OmniModel
    from omni_core.runtime.trainer import train

    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    before = _gloo_threads()
    recipe = build_recipe(root, {**PLANS, "model.flavor": "debug-moe", "train.steps": 2, "train.grad_accum": 1})
    losses = []
    # dp1-tp2 twice: the second run's meshes compare equal to the first's, whose groups are gone by then
    for name in ("dp2-ep2", "dp1-tp2", "dp1-tp2"):
        plan = ParallelPlan.parse(name)
        recipe.parallel.dp_shard, recipe.parallel.tp, recipe.parallel.ep = plan.dp_shard, plan.tp, plan.ep
        losses.append(train(recipe, info, log=lambda _: None, save=False).final_loss)
    gc.collect()
    return {"groups": len(dist.distributed_c10d._world.pg_map), "gloo_threads": (before, _gloo_threads()),
            "models": sum(isinstance(o, OmniModel) for o in gc.get_objects()), "losses": losses}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux's /proc")
def test_training_runs_one_after_another_leave_no_process_group_or_model_behind(tmp_path):
    """A process that trains plan after plan (the estimator's validation) must not pile up gloo groups, whose
    threads poll while idle (70 per rank slowed steps by 30-40%), nor MoE models held by their aux loss."""
    ensure_dataset(build_recipe(tmp_path, {**PLANS, "model.flavor": "debug-moe"}))
    for out in run_ranks(_runs_worker, 2, str(tmp_path)):
        assert out["groups"] == 1, "only the default group is left"
        assert out["gloo_threads"][1] == out["gloo_threads"][0]
        assert out["models"] == 0
        assert out["losses"][1] == pytest.approx(out["losses"][2], rel=1e-6)  # same plan, same seed, same data
