"""The dynamic comparison's deployment rules (estimator.dynamic): one plan per run, chosen on the data its
system chooses on and fitting every step; a run is the sum of its steps; a baseline without balancing waits for
its slowest rank."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from omni_core.common.catalog import GpuCatalog
from omni_core.common.plan import ParallelPlan
from omni_core.estimator.cost import Efficiency, Options, estimate_step
from omni_core.estimator.dynamic import (
    SYSTEMS,
    Drawer,
    DynamicRun,
    StepDraw,
    WorkModel,
    drift_shares,
    first_fitting,
    in_order_imbalance,
    ranked_plans,
    reordered_imbalance,
    sequence_mix,
    stationary_shares,
    step_workload,
)
from omni_core.estimator.paper_workloads import MERGE, PAPER_WORKLOADS, mix_workload, paper_workload
from omni_core.recipe.loader import load_recipe

ROOT = Path(__file__).resolve().parents[2]
H100 = GpuCatalog()["h100"]


@pytest.fixture(scope="module")
def data():
    return load_recipe(ROOT / "recipes" / "dynamic_mix.yaml").data


def toy_draw(works_by_sequence: list[list[float]]) -> StepDraw:
    """A step whose sequences hold images of these patch counts (no attention in the toy work model)."""
    sequence = np.array([s for s, items in enumerate(works_by_sequence) for _ in items])
    patches = np.array([p for items in works_by_sequence for p in items], dtype=float)
    per = np.array([sum(items) for items in works_by_sequence], dtype=float)
    zeros = np.zeros(len(works_by_sequence))
    return StepDraw(np.array([len(i) for i in works_by_sequence], float), per, zeros, zeros, zeros, patches, sequence)


def test_without_balancing_a_step_waits_for_its_slowest_rank():
    work = WorkModel(linear=1.0, quadratic=0.0)
    draw = toy_draw([[3.0], [0.0], [1.0], [1.0]])  # ranks take sequences in order: 3 + 0 and 1 + 1
    assert in_order_imbalance(draw, work, 2) == pytest.approx(3 / 2.5)
    assert in_order_imbalance(draw, work, 1) == 1.0
    # reordering the images (longest first onto the least loaded rank) evens it out: 3 | 1 + 1
    assert reordered_imbalance(draw, work, 2) == pytest.approx(3 / 2.5)
    assert reordered_imbalance(toy_draw([[5.0, 4.0], [3.0, 3.0, 3.0]]), work, 2) == pytest.approx(10 / 9)


def test_megatron_prices_the_slowest_rank_and_omni_its_own_term():
    base = paper_workload("A", 0.5)
    plan_and_options = ranked_plans(base, H100, 64, Efficiency(), "coupled")[0]
    plan = plan_and_options.plan
    assert plan.dp > 1
    seqs = base.global_batch
    draw = toy_draw([[1024.0] * (8 if s < seqs // plan.dp else 2) for s in range(seqs)])  # rank 0 drew the most
    work = WorkModel.of("A")
    slow = step_workload(base, draw, work, SYSTEMS["megatron"], plan)
    llm = sum(layer.flops + layer.attn_flops for layer in base.llm)  # the ranks' LLM work: the same on each
    assert slow.loader_imbalance == pytest.approx(in_order_imbalance(draw, work, plan.dp, llm))
    assert 1.0 < slow.loader_imbalance < in_order_imbalance(draw, work, plan.dp)
    balanced = replace(slow, loader_imbalance=1.0, cache={})
    priced = [estimate_step(w, H100, plan, plan_and_options.options, gpus_per_node=8) for w in (slow, balanced)]
    assert priced[0].step_time_s > priced[1].step_time_s
    assert step_workload(base, draw, work, SYSTEMS["omni"], plan) is base


def test_drawn_steps_follow_the_share_and_repeat(data):
    _, _, seq_len, batch = PAPER_WORKLOADS["A"]
    drawer = Drawer(data, seq_len, batch, seed=3)
    for share in (0.1, 0.5, 0.9):
        draw = drawer.draw(7, share)
        assert draw.patches.sum() / MERGE / (seq_len * batch) == pytest.approx(share, abs=0.08)
        assert draw.image_patches.max() <= data.max_image_patches
    again = drawer.draw(7, 0.5)
    assert np.array_equal(again.image_patches, drawer.draw(7, 0.5).image_patches)
    assert not np.array_equal(again.image_patches, drawer.draw(8, 0.5).image_patches)


def test_trajectories_read_the_recipe(data):
    drift = drift_shares(data.synthetic, 100, 2000)
    assert drift[0] == pytest.approx(0.1) and drift[-1] == pytest.approx(0.9, abs=0.01)
    assert np.all(np.diff(drift) >= 0)
    stationary = stationary_shares(data.synthetic, 10)
    assert np.all(stationary == stationary[0]) and 0 < stationary[0] < 1
    with pytest.raises(ValueError, match="schedule"):
        drift_shares(data.synthetic.model_copy(update={"schedule": []}), 10, 10)


def test_a_plan_is_kept_only_if_it_fits_every_step():
    light, heavy = paper_workload("A", 0.1), paper_workload("A", 0.9)
    ranked = ranked_plans(light, H100, 64, Efficiency(), "coupled")
    assert not estimate_step(heavy, H100, ranked[0].plan, ranked[0].options, gpus_per_node=8).fits
    chosen, refused = first_fitting(ranked, [light, heavy], H100, Efficiency())
    assert chosen is not None and refused and refused[0].startswith(ranked[0].plan.name)
    assert estimate_step(heavy, H100, chosen.plan, chosen.options, gpus_per_node=8).fits


def test_the_candidates_include_the_plans_that_fit_the_heaviest_step():
    """Each Cell keeps a few plans fastest on the data a plan is chosen on; those the heaviest step's own search
    finds join them, priced on that data, so a plan that fits every step is not missed for being 5th."""
    light, heavy = paper_workload("A", 0.1), paper_workload("A", 0.9)

    def key(e):
        return e.plan.name, e.options.micro_batch, e.options.checkpoint

    alone = ranked_plans(light, H100, 64, Efficiency(), "coupled")
    both = ranked_plans(light, H100, 64, Efficiency(), "coupled", heavy)
    for_heavy = {key(e) for e in ranked_plans(heavy, H100, 64, Efficiency(), "coupled")}
    assert for_heavy - {key(e) for e in alone} and for_heavy <= {key(e) for e in both}
    assert [e.step_time_s for e in both] == sorted(e.step_time_s for e in both)
    assert len({key(e) for e in both}) == len(both)  # a plan found by both searches is one candidate
    with_heavy, _ = first_fitting(both, [light, heavy], H100, Efficiency())
    without, _ = first_fitting(alone, [light, heavy], H100, Efficiency())
    assert with_heavy is not None and (without is None or with_heavy.step_time_s <= without.step_time_s)


def test_a_run_is_one_plan_per_system_and_the_sum_of_its_steps(data):
    shares = np.linspace(0.1, 0.9, 6)
    run = DynamicRun("A", data, shares, H100, Efficiency(), seed=1)
    prices = run.price()
    assert set(prices) == set(SYSTEMS)
    assert prices["disttrain"].chosen_on.startswith("run_average") and "+disagg" in prices["disttrain"].plan
    assert prices["megatron"].chosen_on.startswith("first_window")
    _, _, seq_len, batch = PAPER_WORKLOADS["A"]
    drawer, work = Drawer(data, seq_len, batch, seed=1), WorkModel.of("A")
    for name, price in prices.items():
        plan = ParallelPlan.parse(price.plan)
        assert plan.name == price.plan
        total = 0.0
        for step, share in enumerate(shares):
            draw = drawer.draw(step, float(share))
            base = mix_workload("A", sequence_mix(draw, work), f"{step}")
            workload = step_workload(base, draw, work, SYSTEMS[name], plan)
            est = estimate_step(workload, H100, plan, Options(price.micro_batch, price.checkpoint), gpus_per_node=8)
            assert est.fits
            total += est.step_time_s
        assert price.run_s == pytest.approx(total, rel=1e-9)


def test_the_slowest_rank_is_the_expected_maximum_not_its_bound():
    from omni_core.estimator.encoders import expected_max_normal, unbalanced_factor

    # E[max] of n standard normals (tabulated: 0.5642, 0.8463, 1.0294, 1.4236) and the mean of |X1 - X2| / 2
    for n, known in ((2, 0.5642), (3, 0.8463), (4, 1.0294), (8, 1.4236)):
        assert expected_max_normal(n) == pytest.approx(known, abs=2e-4)
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(64) < np.sqrt(2 * np.log(64))
    # two ranks of 2 samples each, per-sample spread 0.88: 1 + 0.88 / sqrt(2) * 0.564
    assert unbalanced_factor(0.88, 2, 2) == pytest.approx(1 + 0.88 / np.sqrt(2) / np.sqrt(np.pi), rel=1e-3)
    assert unbalanced_factor(0.88, 2, 1) == 1.0 and unbalanced_factor(0.0, 2, 8) == 1.0
