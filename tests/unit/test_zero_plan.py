"""The sharding stage in the plan object and the recipe: names read back, defaults unchanged, refusals named."""

from __future__ import annotations

import pytest

from omni_core.common.plan import ParallelPlan, PlanError
from omni_core.recipe.model_sections import ParallelConfig
from omni_core.recipe.schema import recipe_hash
from tests.helpers.recipes import build_recipe


@pytest.mark.parametrize(
    "name,sharding",
    [
        ("dp8", "fsdp"),
        ("dp8z1", "zero1"),
        ("dp8z2", "zero2"),
        ("dp8z0", "replicate"),
        ("dp2x4z1-tp2-pp2v2", "zero1"),
        ("dp2z2-cp2r", "zero2"),
    ],
)
def test_plan_names_carry_the_sharding_stage_and_parse_back(name, sharding):
    plan = ParallelPlan.parse(name)
    assert plan.sharding == sharding
    assert plan.name == name
    assert plan.zero == (sharding != "fsdp")


def test_fsdp_is_the_default_and_names_nothing():
    assert ParallelPlan(dp_shard=8).name == "dp8"
    assert ParallelPlan(dp_shard=8, sharding="zero1").name == "dp8z1"
    with pytest.raises(PlanError, match="cannot parse"):
        ParallelPlan.parse("dp8z3")


def test_the_runtime_refuses_zero_with_experts_or_own_encoder_layouts_by_name():
    with pytest.raises(PlanError, match="sharding=zero1 with ep=2"):
        ParallelPlan.parse("dp2z1-ep2")
    with pytest.raises(PlanError, match=r"sharding=zero2 with encoders\.layout=omni"):
        ParallelPlan.parse("dp2z2+omni")
    with pytest.raises(PlanError, match="sharding='zero3' must be one of"):
        ParallelPlan(sharding="zero3")  # type: ignore[arg-type]


def test_recipe_field_validated_and_default_leaves_the_hash_unchanged(tmp_path):
    assert "sharding" not in ParallelConfig().model_dump()
    assert ParallelConfig(sharding="zero1").model_dump()["sharding"] == "zero1"
    with pytest.raises(ValueError, match="sharding=replicate with ep=4"):
        ParallelConfig(sharding="replicate", ep=4)
    with pytest.raises(ValueError):
        ParallelConfig(sharding="zero9")
    base = build_recipe(tmp_path)
    explicit = build_recipe(tmp_path, {"parallel.sharding": "fsdp"})
    assert recipe_hash(explicit) == recipe_hash(base)
    assert recipe_hash(build_recipe(tmp_path, {"parallel.sharding": "zero1"})) != recipe_hash(base)


def test_from_config_and_recipe_fields_round_trip():
    plan = ParallelPlan.from_config(ParallelConfig(sharding="zero2", tp=2), 8)
    assert plan.name == "dp4z2-tp2"
    assert ParallelPlan.from_config(ParallelConfig(**plan.recipe_fields()), 8) == plan
    with pytest.raises(ValueError, match="plan is auto"):
        ParallelConfig(plan="auto", sharding="zero1")
