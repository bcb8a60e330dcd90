"""ParallelPlan: degrees, names, validation against world and model, meshes."""

from __future__ import annotations

import pytest

from omni_core.common.plan import ModelShape, ParallelPlan, PlanError
from omni_core.recipe.model_sections import ParallelConfig

LLAMA_TINY = ModelShape(n_layers=4, n_heads=8, n_kv_heads=4, seq_len=256)
MOE_TINY = ModelShape(n_layers=4, n_heads=8, n_kv_heads=4, num_experts=4, seq_len=256)


@pytest.mark.parametrize(
    "plan",
    [
        ParallelPlan(dp_shard=4),
        ParallelPlan(dp_replicate=2, dp_shard=2),
        ParallelPlan(dp_shard=2, tp=2, pp=2, cp=2, cp_kind="ring", ep=2),
        ParallelPlan(pp=4, pp_schedule="Interleaved1F1B", virtual_stages=2),
        ParallelPlan(pp=2, pp_schedule="GPipe", cp=4),
    ],
    ids=lambda p: p.name,
)
def test_name_round_trips(plan):
    assert ParallelPlan.parse(plan.name) == plan


def test_name_and_sizes():
    plan = ParallelPlan(dp_shard=2, tp=2, pp=2, cp=2, cp_kind="ring", ep=2)
    assert plan.name == "dp2-tp2-pp2-cp2r-ep2"
    assert plan.world_size == 16 and plan.dp == 2
    assert list(plan.mesh_shape()) == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]


def test_from_config_derives_dp_shard_and_checks_world():
    assert ParallelPlan.from_config(ParallelConfig(tp=2), 8) == ParallelPlan(dp_shard=4, tp=2)
    with pytest.raises(PlanError, match=r"world size 6 is not divisible by pp=1 x dp_replicate=1 x cp=1 x tp=4"):
        ParallelPlan.from_config(ParallelConfig(tp=4), 6)
    with pytest.raises(PlanError, match=r"dp_shard=3 x cp=1 x tp=2 = 6 ranks, but the world size is 8"):
        ParallelPlan.from_config(ParallelConfig(tp=2, dp_shard=3), 8)


def test_invalid_degrees_are_named():
    with pytest.raises(PlanError, match=r"tp=0 must be >= 1"):
        ParallelPlan(tp=0)
    with pytest.raises(PlanError, match=r"ep=4 must divide dp_shard\*cp=2"):
        ParallelPlan(dp_shard=2, ep=4)
    with pytest.raises(PlanError, match=r"Interleaved1F1B needs virtual_stages >= 2"):
        ParallelPlan(pp=2, pp_schedule="Interleaved1F1B")
    with pytest.raises(PlanError, match=r"cannot parse plan name 'tp2'"):
        ParallelPlan.parse("tp2")


def test_model_fit_names_every_degree_that_does_not_divide():
    ParallelPlan(dp_shard=2, tp=2, pp=2, cp=2).check_model(LLAMA_TINY)
    ParallelPlan(dp_shard=2, ep=2).check_model(MOE_TINY)
    with pytest.raises(PlanError) as err:
        ParallelPlan(tp=8, pp=8, cp=2, cp_kind="ring", dp_shard=2, ep=2).check_model(
            ModelShape(n_layers=4, n_heads=8, n_kv_heads=4, seq_len=250)
        )
    message = str(err.value)
    for expected in ("tp=8 does not divide n_kv_heads=4", "pp=8 x virtual_stages=1 exceeds n_layers=4",
                     "ep=2 needs an MoE model", "cp=2 (ring) x tp=8 needs seq_len=250 divisible by 32"):
        assert expected in message
    with pytest.raises(PlanError, match=r"cp=4 \(ulysses\) does not divide the 2 heads per tp rank"):
        ParallelPlan(tp=4, cp=4).check_model(ModelShape(n_layers=4, n_heads=8, n_kv_heads=8))
    with pytest.raises(PlanError, match=r"ep=4 does not divide num_experts=6"):
        ParallelPlan(dp_shard=4, ep=4).check_model(ModelShape(n_layers=2, n_heads=4, n_kv_heads=4, num_experts=6))


def test_plans_that_would_split_a_tied_head_or_a_window_are_refused():
    tied = ModelShape(n_layers=4, n_heads=8, n_kv_heads=4, tied_embeddings=True)
    ParallelPlan(dp_shard=4).check_model(tied)
    with pytest.raises(PlanError) as err:
        ParallelPlan(tp=2, pp=2).check_model(tied)
    assert "pp=2 would put the tied embedding and output head on different stages" in str(err.value)
    assert "tp=2 shards the embedding and the output head apart" in str(err.value)
    windowed = ModelShape(n_layers=4, n_heads=8, n_kv_heads=4, sliding_window=True)
    ParallelPlan(tp=2, pp=2).check_model(windowed)
    with pytest.raises(PlanError, match="cp=2: context-parallel attention has no sliding window"):
        ParallelPlan(cp=2).check_model(windowed)


def test_mesh_has_one_named_dimension_per_degree():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from omni_core.parallel.parallelize import build_meshes

        mesh = build_meshes(ParallelPlan(), "cpu").world
        assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        assert mesh["tp"].size() == 1 and mesh.size() == 1
    finally:
        dist.destroy_process_group()


def test_fsdp_mesh_has_a_replicate_dimension_only_with_replicas():
    """With one replica FSDP2 would all-reduce each unit's gradients over a group of one rank (a blocking call
    per unit per step); the meshes are built on a fake 4-rank process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        from omni_core.parallel.parallelize import build_meshes

        shapes = {}
        for name in ("dp4", "dp1-cp4u", "dp2x2", "dp4-ep2", "dp2x2-ep2"):
            meshes = build_meshes(ParallelPlan.parse(name), "cpu")
            shapes[name] = (meshes.dp_mesh.mesh_dim_names, meshes.dp_mesh.shape)
            if meshes.expert_dp_mesh is not None:
                shapes[f"{name} experts"] = (meshes.expert_dp_mesh.mesh_dim_names, meshes.expert_dp_mesh.shape)
        assert shapes == {
            "dp4": (("dp_shard_cp",), (4,)), "dp1-cp4u": (("dp_shard_cp",), (4,)),
            "dp2x2": (("dp_replicate", "dp_shard_cp"), (2, 2)),
            "dp4-ep2": (("dp_shard_cp",), (4,)), "dp4-ep2 experts": (("dp_mod_ep",), (2,)),
            "dp2x2-ep2": (("dp_replicate", "dp_shard_cp"), (2, 2)),
            "dp2x2-ep2 experts": (("dp_replicate", "dp_mod_ep"), (2, 1)),
        }
    finally:
        dist.destroy_process_group()


def test_pipeline_schedules_need_enough_microbatches():
    ParallelPlan.parse("dp1-pp2g").check_microbatches(1)
    ParallelPlan.parse("dp1-pp2").check_microbatches(2)
    with pytest.raises(PlanError, match=r"pp=2 \(1F1B\) needs at least 2 micro-batches per step, got 1"):
        ParallelPlan.parse("dp1-pp2").check_microbatches(1)
    ParallelPlan.parse("dp1-pp2v2").check_microbatches(4)
    with pytest.raises(PlanError, match=r"rounds of 2, which must divide the 5"):
        ParallelPlan.parse("dp1-pp2v2").check_microbatches(5)


@pytest.mark.parametrize("name", ["dp2", "dp1-tp2+omni", "dp2+omni.v-sp2-t256.a-fsdp", "dp1+disagg1",
                                  "dp1-pp2+omni-joint.v-sp2-t64", "dp1+disagg1-joint",
                                  "dp1-pp2+omni.a-sp2-m64-fsdp", "dp2x2-tp2-pp4v2-cp2r-ep2+omni.v-t64"])
def test_plan_names_with_encoders_round_trip(name):
    assert ParallelPlan.parse(name).name == name


def test_encoder_plan_sizes_and_ranks():
    omni = ParallelPlan.parse("dp1-tp2+omni")
    assert (omni.world_size, list(omni.encoder_ranks)) == (2, [0, 1])
    disagg = ParallelPlan.parse("dp2+disagg1")
    assert (disagg.llm_world_size, disagg.world_size, list(disagg.encoder_ranks)) == (2, 3, [2])
    cfg = ParallelConfig(encoders={"layout": "disaggregated", "ranks": 1})
    assert ParallelPlan.from_config(cfg, 3) == disagg


@pytest.mark.parametrize("name, message", [
    ("dp2+coupled.v-sp2-t2", "encoders.vision is set, which needs layout omni or disaggregated"),
    ("dp2+omni.v-sp2", r"encoders.vision.lssp=2 needs a long-item threshold"),
    ("dp2+omni.v-x3", "unknown setting 'x3'"),
    ("dp2+disagg0", "encoders.ranks must be >= 1"),
    ("dp2+coupled-joint", "encoders.schedule=joint needs layout omni or disaggregated"),
])
def test_bad_encoder_plans_are_named(name, message):
    with pytest.raises(PlanError, match=message):
        ParallelPlan.parse(name)


def test_recipe_encoder_fields_are_checked_by_name():
    with pytest.raises(ValueError, match="encoders.ranks=2 needs layout disaggregated"):
        ParallelConfig(encoders={"layout": "omni", "ranks": 2})
    with pytest.raises(ValueError, match="encoders.audio.lssp=4 needs a long-item threshold"):
        ParallelConfig(encoders={"layout": "omni", "audio": {"lssp": 4}})
    with pytest.raises(ValueError, match="encoders.schedule=joint needs layout omni or disaggregated"):
        ParallelConfig(encoders={"schedule": "joint"})
    joint = ParallelConfig(pp=2, encoders={"layout": "omni", "schedule": "joint"})
    plan = ParallelPlan.from_config(joint, 2)
    assert plan.name == "dp1-pp2+omni-joint" and ParallelConfig(**plan.recipe_fields()).encoders == joint.encoders
