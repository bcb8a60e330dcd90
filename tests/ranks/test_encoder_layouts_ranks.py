"""The `omni` encoder layout on gloo: encoders over every rank under their own plan (LSSP for long items,
replicated or FSDP-sharded weights), the handoff into the LLM's layout, and the three-phase step, all against
one process; and the `disaggregated` baseline (encoders on ranks of their own) the same way.

Tolerances are those of `tests.helpers.plans.check_plans`: losses rel 1e-5, gradients rtol 1e-3 / atol 1e-6
(fp32; the layouts sum the same terms in other orders)."""

from __future__ import annotations

import pytest
import torch

from omni_core.common.plan import ParallelPlan
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.ranks import run_ranks
from omni_core.runtime.replica import build_replica
from omni_core.runtime.step import train_step
from tests.helpers.models import N_MELS, PATCH_SIZE, make_batch
from tests.helpers.plans import CapturingOptimizers, check_plans
from tests.helpers.recipes import build_recipe

LSSP = "omni.v-sp2-t16.a-sp2-t16"  # the debug data's images and clips are mostly over 16 tokens


def test_omni_layout_trains_like_one_process_on_two_ranks(tmp_path):
    """On the grouped loaders' balanced batches (data.balance), which the handoff reshards into each CP kind."""
    plans = ["dp2+omni", "dp1-tp2+omni", "dp1-cp2u+omni", "dp1-cp2r+omni", "dp1-pp2+omni", "dp1-pp2g+omni",
             f"dp2+{LSSP}", f"dp1-tp2+{LSSP}", f"dp1-pp2+{LSSP}", "dp2"]
    metrics = check_plans(tmp_path, 2, [("debug", name) for name in plans], balanced=True)
    for (_, name), steps in metrics.items():
        assert all(m["imbalance_pred_total"] < 1.1 for m in steps), name
        if "omni" not in name:
            continue
        assert all(m["handoff_bytes"] > 0 for m in steps), name
        assert all(m["encoder_s_max"] > 0 for m in steps), name
        if "sp2" in name:
            assert sum(m["lssp_items"] for m in steps) > 0, f"{name}: no item was long enough to be split"


def test_omni_layout_trains_like_one_process_on_four_ranks(tmp_path):
    check_plans(tmp_path, 4, [("debug", "dp2-tp2+omni"), ("debug", "dp2-pp2+omni.v-sp4-t16"),
                              ("debug-moe", "dp2-cp2u-ep2+omni.a-sp2-t16")])


def test_disaggregated_layout_trains_like_one_process(tmp_path):
    """The encoders on the last rank, the LLM's dp2, tp2 and pp2 on the others (world 3), and on one LLM rank."""
    check_plans(tmp_path, 2, [("debug", "dp1+disagg1")])
    metrics = check_plans(tmp_path, 3, [("debug", "dp2+disagg1"), ("debug", "dp1-tp2+disagg1"),
                                        ("debug", "dp1-pp2+disagg1")])
    assert all(m["bubble_pct"] > 0 for m in metrics["debug", "dp1-pp2+disagg1"])
    assert all(m["bubble_pct"] == 0 for m in metrics["debug", "dp2+disagg1"])


# the recipe of the hand-made batches below (SHARDS): no dataset is read
PARTIAL = {"experiment.name": "partial", "experiment.seed": 3, "data.path": "unused", "data.seq_len": 128,
           "data.patch_size": PATCH_SIZE, "data.n_mels": N_MELS, "train.steps": 2, "train.lr": 1e-3,
           "train.warmup_steps": 1, "train.grad_accum": 1, "train.dtype": "float32"}


SHARDS = [  # shard 0 holds every image, video and clip of the step, shard 1 only text
    make_batch([[("text", 5), ("image", (4, 6)), ("text", 4)], [("audio", 40), ("text", 9)],
                [("video", (6, 4, 4)), ("text", 3)]], seed=1),
    make_batch([[("text", 30)], [("text", 21)]], seed=2),
]


def _partial_worker(rank: int, world: int, plan_name: str, freeze: tuple[str, ...] = ()) -> tuple[float, dict]:
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    plan = ParallelPlan.parse(plan_name)
    recipe = build_recipe(overrides={**PARTIAL, "model.freeze": list(freeze),
                                     "train.grad_accum": len(SHARDS) // plan.dp})
    replica = build_replica(recipe, plan, info, torch.float32)
    optimizers = CapturingOptimizers(replica.parts, recipe)
    batches = SHARDS[plan.data_rank(rank)::plan.dp] if replica.loads_data else []
    loss = train_step(replica, optimizers, batches, grad_clip=0.0).metrics["loss"]
    return loss, optimizers.grads


@pytest.mark.parametrize("plan", ["dp2+omni", "dp2+omni.v-sp2-t8.a-sp2-t8", "dp1+disagg1", "dp2+omni.v-fsdp.a-fsdp"])
def test_a_step_where_only_one_shard_holds_images_and_audio(plan):
    """Rank 1 has nothing to encode from its own batch; under LSSP it still encodes chunks of rank 0's items
    (the video as frame groups). Either way every rank enters every collective and the gradients are those
    of one process."""
    (ref_loss, ref_grads), = run_ranks(_partial_worker, 1, "dp1")
    merged: dict[str, torch.Tensor] = {}
    for loss, grads in run_ranks(_partial_worker, 2, plan):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        merged.update(grads)  # disaggregated: the encoders' gradients are on their own rank
    assert merged.keys() == ref_grads.keys()
    for name, expected in ref_grads.items():
        torch.testing.assert_close(merged[name], expected, rtol=1e-3, atol=1e-6, msg=name)


@pytest.mark.parametrize("freeze", [("vision", "audio"), ("vision", "audio", "projectors")])
def test_frozen_encoders_skip_their_backward(freeze):
    """Frozen encoders get no gradient (autograd stops at the trainable projectors, or, with those frozen
    too, the handoff has no backward at all); what trains matches one process."""
    (ref_loss, ref_grads), = run_ranks(_partial_worker, 1, "dp1", freeze)
    merged: dict[str, torch.Tensor] = {}
    for loss, grads in run_ranks(_partial_worker, 2, "dp2+omni.v-fsdp", freeze):  # sharded and replicated
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        merged.update(grads)
    assert merged.keys() == ref_grads.keys()
    assert not any(name.startswith(freeze) for name in merged)
    for name, expected in ref_grads.items():
        torch.testing.assert_close(merged[name], expected, rtol=1e-3, atol=1e-6, msg=name)


def test_joint_schedule_trains_like_one_process(tmp_path):
    """The joint schedule (encoders per micro-batch in the ranks' idle time, rows handed off point to point as
    they are made): 1F1B and GPipe pipelines, LSSP inside the encoder thread, TP consumers, and DistTrain's
    pipelined encoders on a rank of their own. The bubble is measured on every pipelined step."""
    metrics = check_plans(tmp_path, 2, [("debug", name) for name in (
        "dp1-pp2+omni-joint", "dp1-pp2g+omni-joint", f"dp1-pp2+{LSSP.replace('omni', 'omni-joint')}",
        "dp1-tp2+omni-joint", "dp2+omni-joint")], balanced=True)
    for (_, name), steps in metrics.items():
        assert all(m["handoff_bytes"] > 0 and m["encoder_s_max"] > 0 for m in steps), name
        # measured on pipelined steps (the joint schedule may fill it: no lower bound), none without a pipeline
        assert all(0 <= m["bubble_pct"] < 100 if "pp2" in name else m["bubble_pct"] == 0 for m in steps), name
    check_plans(tmp_path, 3, [("debug", "dp1-pp2+disagg1-joint")])


@pytest.mark.parametrize("plan", ["dp2+omni-joint", "dp2+omni-joint.v-sp2-t8.a-sp2-t8", "dp1+disagg1-joint"])
def test_joint_schedule_where_only_one_shard_holds_images_and_audio(plan):
    """Rank 1's encoder thread encodes rank 0's items (or nothing) and sends their rows as they are made."""
    (ref_loss, ref_grads), = run_ranks(_partial_worker, 1, "dp1")
    merged: dict[str, torch.Tensor] = {}
    for loss, grads in run_ranks(_partial_worker, 2, plan):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        merged.update(grads)
    assert merged.keys() == ref_grads.keys()
    for name, expected in ref_grads.items():
        torch.testing.assert_close(merged[name], expected, rtol=1e-3, atol=1e-6, msg=name)


def _checkpointed_worker(rank: int, world: int) -> dict[str, bool]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    recipe = build_recipe(overrides={**PARTIAL, "train.activation_checkpointing": True})
    model = build_replica(recipe, ParallelPlan.parse("dp2+omni.v-fsdp"), info, torch.float32).parts[0]
    return {name: all(isinstance(b, CheckpointWrapper) for b in getattr(model, name).layers)
            for name in ("vision", "audio")}


def test_activation_checkpointing_leaves_sharded_blocks_to_their_own_recomputation():
    """Sharded blocks already recompute their forward in backward; wrapping them too would recompute twice."""
    for wrapped in run_ranks(_checkpointed_worker, 2):
        assert wrapped == {"vision": False, "audio": True}


def test_sharded_encoder_weights_train_like_one_process(tmp_path):
    """Encoder weights FSDP-sharded over the encoders' group (gathered once per step, gradients
    reduce-scattered): beside replicated ones, under LSSP and TP consumers, in the joint schedule's thread, and
    over the encoders' own two ranks (`disaggregated`)."""
    check_plans(tmp_path, 2, [("debug", name) for name in (
        "dp2+omni.v-fsdp.a-fsdp", "dp1-tp2+omni.v-sp2-t16-fsdp.a-sp2-t16", "dp1-pp2+omni-joint.v-fsdp")],
        balanced=True)
    check_plans(tmp_path, 3, [("debug", "dp1+disagg2.v-fsdp.a-fsdp")])


def _shard_sizes_worker(rank: int, world: int) -> dict[str, int]:
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    replica = build_replica(build_recipe(overrides=PARTIAL), ParallelPlan.parse("dp2+omni.v-fsdp"), info,
                            torch.float32)
    held = {name: 0 for name in ("vision", "projectors.image", "audio")}
    for name, param in replica.parts[0].named_parameters():
        for prefix in held:
            if name.startswith(prefix + "."):
                held[prefix] += param.to_local().numel() if hasattr(param, "to_local") else param.numel()
    return held


def test_a_sharded_encoder_keeps_its_share_of_the_weights_at_rest():
    """The vision encoder and its projector are sharded over the two ranks (their optimizer state follows the
    registered shards); the replicated audio encoder is whole on both."""
    from omni_core.models.omni import build_model

    model = build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=3)
    whole = {name: sum(p.numel() for p in module.parameters()) for name, module in
             (("vision", model.vision), ("projectors.image", model.projectors["image"]), ("audio", model.audio))}
    held = run_ranks(_shard_sizes_worker, 2)
    for name in ("vision", "projectors.image"):
        assert sum(rank[name] for rank in held) == whole[name]
        assert all(rank[name] <= whole[name] * 0.6 for rank in held), name
    assert all(rank["audio"] == whole["audio"] for rank in held)


def _uneven_shards_worker(rank: int, world: int) -> dict:
    from torch import nn

    from omni_core.parallel.encoder_shards import EncoderShards, owned

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 1))  # 4 rows over 3 ranks: 2, 2 and none
    reference = [p.detach().clone() for p in module.parameters()]
    inputs = [torch.randn(2, 5, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    shards = EncoderShards(owned(module), None, torch.device("cpu"))
    local_rows = [p.to_local().shape[0] for p in module.parameters()]
    shards.gather()
    gathered = all(torch.equal(p, r) for p, r in zip(module.parameters(), reference, strict=True))
    module(inputs[rank]).sum().backward()
    shards.reduce()
    grads = [p.grad.full_tensor() for p in shards.params]
    return {"local_rows": local_rows, "gathered": gathered, "grads": grads, "reference": reference, "inputs": inputs}


def test_sharded_weights_split_unevenly_gather_and_reduce_exactly():
    """Shards of torch.chunk's sizes (a rank may hold no row): gathered, the weights are the original ones; the
    reduced gradients are the sum of every rank's."""
    from torch import nn

    outs = run_ranks(_uneven_shards_worker, 3)
    assert [o["local_rows"] for o in outs] == [[2, 2, 1, 1], [2, 2, 0, 0], [0, 0, 0, 0]]
    assert all(o["gathered"] for o in outs)
    module = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 1))
    with torch.no_grad():
        for param, weights in zip(module.parameters(), outs[0]["reference"], strict=True):
            param.copy_(weights)
    sum(module(x).sum() for x in outs[0]["inputs"]).backward()
    for out in outs:
        for grad, param in zip(out["grads"], module.parameters(), strict=True):
            torch.testing.assert_close(grad, param.grad)


def _blocks_held_worker(rank: int, world: int) -> list[int]:
    from torch.distributed.tensor import DTensor

    from omni_core.parallel.encoder_shards import EncoderShards

    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    recipe = build_recipe(overrides=PARTIAL)  # one batch a step
    replica = build_replica(recipe, ParallelPlan.parse("dp2+omni.v-fsdp"), info, torch.float32)
    layers = replica.parts[0].vision.layers
    held, gather = [], EncoderShards.gather

    def counting(self, trainable=True):
        gather(self, trainable)
        held.append(sum(not isinstance(p, DTensor) for layer in layers for p in layer.parameters()))

    EncoderShards.gather = counting
    try:
        train_step(replica, CapturingOptimizers(replica.parts, recipe), SHARDS[rank:rank + 1], grad_clip=0.0)
    finally:
        EncoderShards.gather = gather
    return held


def test_a_sharded_encoder_holds_one_block_whole_at_a_time():
    """Each block is gathered for its forward and again for its backward, alone: never two blocks' weights whole
    at once (the stem and projector, gathered for the step, hold no block parameter)."""
    from omni_core.models.omni import build_model

    per_block = sum(1 for _ in build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=3).vision.layers[0]
                    .parameters())
    layers = len(build_model("debug", patch_size=PATCH_SIZE, n_mels=N_MELS, seed=3).vision.layers)
    for held in run_ranks(_blocks_held_worker, 2):
        assert held.count(per_block) == 2 * layers  # forward and backward, block by block
        assert set(held) == {0, per_block}  # the step-level gather (stem, projector) holds none
