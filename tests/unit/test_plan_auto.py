"""The estimate stage's CellTable as the plan of what trains: `parallel.plan: auto` in the recipe, its
resolution from a CellTable, and the scheduler's oracle answering from the table instead of estimating again."""

from __future__ import annotations

import pytest

from omni_core.common.plan import ParallelPlan, PlanError
from omni_core.estimator.recipe_cells import estimate_own_cells, estimate_recipe, plan_overrides, with_best_plan
from omni_core.estimator.search import CellRow, CellTable
from omni_core.recipe import RecipeError, override_recipe
from omni_core.recipe.model_sections import ParallelConfig
from tests.helpers.recipes import build_recipe

AUTO = {"experiment.name": "auto", "model.flavor": "debug", "data.seq_len": 256, "parallel.nproc": 2,
        "parallel.plan": "auto", "train.grad_accum": 2}
# two slots of this machine and one job to place on them
TWO_SLOTS = {"experiment.name": "two", "data.seq_len": 256, "cluster.slots": 2,
             "jobs": [{"name": "a", "model": "debug", "global_batch": 2, "iterations": 4}]}


def row(job: str, gpu_type: str, num_gpus: int, pp: int, samples_per_s: float, plan: str = "dp2",
        nodes: int = 1) -> CellRow:
    return CellRow(job=job, gpu_type=gpu_type, num_gpus=num_gpus, nodes=nodes, gpus_per_node=num_gpus // nodes, pp=pp,
                   layout="omni", plan=plan, micro_batch=1, checkpoint=False, step_time_s=1 / samples_per_s,
                   samples_per_s=samples_per_s, peak_mem_gb=0.5, breakdown={"compute": 0.1}, runners_up=[])


def test_auto_refuses_degrees_it_would_ignore_by_name():
    with pytest.raises(ValueError, match="plan is auto, so the estimate stage chooses tp, cp_kind"):
        ParallelConfig(plan="auto", tp=2, cp_kind="ring")
    assert ParallelConfig(plan="auto", nproc=4).nproc == 4  # the Cell's size is the user's to give


def test_the_runtime_refuses_an_unresolved_auto_plan():
    with pytest.raises(PlanError, match="parallel.plan is auto"):
        ParallelPlan.from_config(ParallelConfig(plan="auto", nproc=2), 2)


def test_overrides_apply_to_a_resolved_recipe_and_are_checked_like_a_file():
    recipe = build_recipe(overrides=AUTO)
    assert override_recipe(recipe, ["train.steps=7"]).train.steps == 7
    assert override_recipe(recipe, []) is recipe
    with pytest.raises(RecipeError, match="--set train.stepz=1: train.stepz: unknown key"):
        override_recipe(recipe, ["train.stepz=1"])


def test_plan_overrides_keep_the_global_batch_and_refuse_what_cannot():
    values = dict(o.split("=", 1) for o in plan_overrides(ParallelPlan.parse("dp2-tp2"), 2, True, 8))
    assert (values["parallel.nproc"], values["parallel.tp"], values["parallel.dp_shard"]) == ("4", "2", "2")
    assert (values["data.micro_batch"], values["train.grad_accum"]) == ("2", "2")  # 2 x dp 2 x 2 = 8
    assert values["train.activation_checkpointing"] == "true" and values["parallel.plan"] == '"explicit"'
    with pytest.raises(ValueError, match="does not divide"):
        plan_overrides(ParallelPlan.parse("dp2"), 3, False, 8)


def test_best_cells_take_the_fastest_pipeline_depth_per_cell():
    table = CellTable(cells=[row("a", "cpu", 2, 1, 3.0), row("a", "cpu", 2, 2, 5.0, "dp1-pp2"),
                             row("b", "cpu", 2, 1, 9.0), row("a", "cpu", 1, 1, 2.0, "dp1")], unfit=[])
    best = table.best_cells("a")
    assert sorted(best) == [("cpu", 1), ("cpu", 2)] and best["cpu", 2].plan == "dp1-pp2"
    result = best["cpu", 2].cell_result()
    assert (result.plan, result.samples_per_s, result.pp) == (ParallelPlan.parse("dp1-pp2"), 5.0, 2)


def test_auto_runs_the_tables_best_plan_for_its_cell():
    recipe = build_recipe(overrides=AUTO)
    table = CellTable(cells=[row("auto", "cpu", 2, 1, 3.0), row("auto", "cpu", 2, 2, 5.0, "dp1-pp2"),
                             row("auto", "cpu", 4, 1, 50.0, "dp4")], unfit=[])
    planned = with_best_plan(recipe, table, "cpu")
    assert ParallelPlan.from_config(planned.parallel, 2) == ParallelPlan.parse("dp1-pp2")
    # the estimate priced micro_batch 1 x grad_accum 2 x nproc 2 = 4 sequences; dp 1 keeps them with 4 micro-batches
    assert (planned.parallel.plan, planned.data.micro_batch, planned.train.grad_accum) == ("explicit", 1, 4)
    with pytest.raises(RecipeError, match=r"parallel.plan: auto, but the estimate has no Cell a100 x2 .*cpu x2, cpu x4"):
        with_best_plan(recipe, table, "a100")
    two_nodes = CellTable(cells=[row("auto", "cpu", 2, 1, 3.0, nodes=2)], unfit=[])
    with pytest.raises(RecipeError, match="priced cpu x2 as 2 nodes of 1, and the train stage runs on one node"):
        with_best_plan(recipe, two_nodes, "cpu")


def test_auto_without_the_estimate_stage_prices_its_own_cells_and_gets_a_plan_that_runs():
    recipe = build_recipe(overrides=AUTO)
    table = estimate_own_cells(recipe, "cpu")
    assert {(c.gpu_type, c.num_gpus, c.nodes) for c in table.cells} == {("cpu", 1, 1), ("cpu", 2, 1)}
    planned = with_best_plan(recipe, table, "cpu")
    plan = ParallelPlan.from_config(planned.parallel, 2)
    assert plan.name == table.best_cells("auto")["cpu", 2].plan


def test_the_schedulers_oracle_answers_from_the_estimate_stage_table(monkeypatch):
    from omni_core.estimator import search
    from omni_core.scheduler.local import real_cluster, recipe_oracle

    recipe = build_recipe(overrides=TWO_SLOTS)
    table = estimate_recipe(recipe)
    expected = {key: r.samples_per_s for key, r in table.best_cells("a").items()}

    def never(*args, **kwargs):
        raise AssertionError("the oracle estimated a Cell the table holds")

    monkeypatch.setattr(search, "best_for_gpus", never)
    oracle = recipe_oracle(recipe, real_cluster(recipe), cells=table)
    held = [(gpu_type, n) for gpu_type, n in expected if n <= 2]
    assert held == [("cpu", 1), ("cpu", 2)]
    for gpu_type, n in held:
        assert oracle.throughput("debug", 2, gpu_type, n) == expected[gpu_type, n]
        assert oracle.best_plan("debug", 2, gpu_type, n).name == table.best_cells("a")[gpu_type, n].plan


def test_the_oracle_does_not_take_a_cell_priced_as_another_node_shape(monkeypatch):
    from omni_core.estimator import search
    from omni_core.scheduler.local import real_cluster, recipe_oracle

    recipe = build_recipe(overrides=TWO_SLOTS)
    table = CellTable(cells=[row("a", "cpu", 2, 1, 1e6, nodes=2), row("a", "cpu", 1, 1, 7.0, "dp1")], unfit=[])
    searched = []
    monkeypatch.setattr(search, "best_for_gpus", lambda *args, **kwargs: searched.append(args[2]))
    oracle = recipe_oracle(recipe, real_cluster(recipe), cells=table)
    assert oracle.throughput("debug", 2, "cpu", 1) == 7.0  # one node of one: the table's
    assert oracle.throughput("debug", 2, "cpu", 2) is None and searched == [2]  # 2 nodes of 1 is not these slots
