"""Host syncs of a training step under the `omni` encoder layout on two gloo ranks (issue #46 item 3): the
encoder step's items, assignment, compute and handoff read their shapes from the batches' host layouts, so a
rank's count does not grow with its micro-batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omni_core.common.plan import ParallelPlan
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.ranks import run_ranks
from omni_core.runtime.replica import build_replica
from omni_core.runtime.step import train_step
from omni_core.runtime.sync_count import count_host_syncs
from tests.helpers.models import MIXED_DOCS, N_MELS, PATCH_SIZE, VIDEO_DOCS, make_batch
from tests.helpers.recipes import build_recipe

RECIPE = {"experiment.name": "syncs", "experiment.seed": 3, "data.path": "unused", "data.seq_len": 128,
          "data.patch_size": PATCH_SIZE, "data.n_mels": N_MELS, "train.steps": 4, "train.warmup_steps": 1,
          "train.dtype": "float32"}


def _syncs_worker(rank: int, world: int, plan_name: str, micro: int, flavor: str = "debug") -> tuple[int, str]:
    """This rank's host reads in its second step (the first makes optimizer state and device copies once).

    Not counted: AdamW's step counters, and the encoder step's metadata exchange (`dist.all_gather_object`),
    which on a GPU runs over the `cpu:gloo` half of the process group on host tensors (`runtime.dist`)."""
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    recipe = build_recipe(overrides={**RECIPE, "model.flavor": flavor, "train.grad_accum": micro})
    replica = build_replica(recipe, ParallelPlan.parse(plan_name), info, torch.float32)
    optimizers = Optimizers(replica.parts, recipe)
    for step in range(2):
        batches = [make_batch(MIXED_DOCS + VIDEO_DOCS, seed=100 * step + 10 * rank + i) for i in range(micro)]
        counters = {id(s["step"]) for opt in optimizers.optimizers for s in opt.state.values()}
        with count_host_syncs(ignore=lambda tensor, ids=counters: id(tensor) in ids) as counter:
            gather = dist.all_gather_object

            def gather_on_host(*args, gather=gather, counter=counter, **kwargs):
                with counter.paused():
                    return gather(*args, **kwargs)

            dist.all_gather_object = gather_on_host
            try:
                train_step(replica, optimizers, batches, grad_clip=1.0)
            finally:
                dist.all_gather_object = gather
    return counter.total, counter.summary()


@pytest.mark.parametrize("plan", ["dp2+omni", "dp2+omni.v-sp2-t8.a-sp2-t8"])
def test_the_omni_layouts_step_reads_the_host_a_fixed_number_of_times(plan):
    one, three = (run_ranks(_syncs_worker, 2, plan, micro) for micro in (1, 3))
    for rank, ((base, base_sites), (grown, grown_sites)) in enumerate(zip(one, three, strict=True)):
        assert grown == base, f"rank {rank}, 3 micro-batches: {grown_sites}; 1: {base_sites}"
        assert base <= 1, f"rank {rank}: {base_sites}"


def test_expert_parallelism_reads_the_host_once_per_moe_layer_and_micro_batch():
    """Under ep > 1 the token all-to-alls need their split sizes on the host: one read per MoE layer forward
    (`parallel.expert`), beside the step's one."""
    from omni_core.models.flavors import get_flavor

    layers = get_flavor("debug-moe", patch_size=PATCH_SIZE, n_mels=N_MELS).llm.n_layers
    for micro in (1, 3):
        for rank, (total, sites) in enumerate(run_ranks(_syncs_worker, 2, "dp2-ep2", micro, "debug-moe")):
            assert total == 1 + layers * micro, f"rank {rank}, {micro} micro-batches: {sites}"
