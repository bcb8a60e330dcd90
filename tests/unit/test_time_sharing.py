"""Ranks that time-share fewer cores (CPU nodes, `GpuSpec.cores`): a rank runs whole on the core it was placed
on and a rank waiting in a collective lends its core, so a step's stretch between collectives lasts as long as
the fullest core (`cost.fullest_core_seconds`), and the omni encoders' phase time-shares like the LLM's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omni_core.common.catalog import GpuCatalog
from omni_core.common.plan import ParallelPlan
from omni_core.estimator.cost import Efficiency, Options, estimate_step, fullest_core_seconds, shared_encoder_seconds
from omni_core.estimator.encoders import omni_encoder_seconds
from omni_core.estimator.paper_workloads import paper_workload
from omni_core.estimator.terms import PlanTerms

# a model of workload A fits four of these: only the arithmetic is tested
ROOMY = replace(GpuCatalog()["h100"], mem_gb=1024)


def test_balanced_ranks_take_rounds_of_one_rank_per_core():
    for ranks, rounds in ((2, 1), (3, 2), (4, 2), (5, 3)):
        assert fullest_core_seconds(1.0, 1.0, ranks, 2) == pytest.approx(rounds)


def test_an_unbalanced_step_waits_for_the_longest_rank_and_its_core_mates():
    """Measured on 2 cores (issue #49): 4 ranks with work 2, 1, 1, 1 took 2.8-3.2 units, not their total over
    the cores (2.5) nor two rounds of the longest (4); one busy rank of four takes its own work (the waiting
    ranks sleep), not two rounds of the ranks' average (0.5)."""
    assert fullest_core_seconds(2.0, 1.0, 4, 2) == pytest.approx(3.0)
    assert fullest_core_seconds(3.0, 1.0, 4, 2) == pytest.approx(4.0)
    assert fullest_core_seconds(1.0, 0.0, 4, 2) == pytest.approx(1.0)
    # 3 ranks: the longest shares its core two times in three (2 + 1), else the other core holds two (2)
    assert fullest_core_seconds(2.0, 1.0, 3, 2) == pytest.approx(2 / 3 * 3 + 1 / 3 * 2)
    assert fullest_core_seconds(2.0, 1.0, 2, 2) == 2.0  # a core each: the longest rank
    for longest, others, ranks in ((2.0, 1.0, 3), (5.0, 1.0, 4), (1.0, 1.0, 5), (1.5, 0.2, 6)):
        total = longest + (ranks - 1) * others
        assert max(longest, total / 2) <= fullest_core_seconds(longest, others, ranks, 2) <= longest + total / 2


def _shared(plan: str, workload, cores: int = 2):
    return estimate_step(
        workload, replace(ROOMY, cores=cores), ParallelPlan.parse(plan), Options(1, checkpoint=True), gpus_per_node=4
    )


def test_coupled_encoders_on_unbalanced_batches_share_the_longest_ranks_core_with_average_ranks():
    """Four coupled ranks on two cores: the rank with the most images shares its core with one rank of mean
    work, not with another as busy as itself (the old rounds x longest)."""
    unbalanced = replace(paper_workload("A", 0.9), global_batch=16, encoder_cv=2.0, cache={})
    est = _shared("dp4", unbalanced)
    b = est.breakdown
    longest = b["device_s"] + b["runtime_s"] + b["host_s"]  # stage 0's priced rank: the most encoder work
    assert longest + b["sync_s"] < est.step_time_s < 0.95 * (2 * longest + b["sync_s"])
    balanced = _shared("dp4", replace(unbalanced, encoder_cv=0.0, cache={}))
    b = balanced.breakdown
    assert balanced.step_time_s == pytest.approx(2 * (b["device_s"] + b["runtime_s"] + b["host_s"]) + b["sync_s"])


def test_omni_encoders_time_share_the_cores_like_the_llm():
    """The omni encoders' phase runs on every rank: four ranks on two cores take it in two rounds too."""
    workload = replace(paper_workload("A", 0.9), global_batch=16, cache={})
    shared, own = _shared("dp4+omni", workload), _shared("dp4+omni", workload, cores=4)
    b = shared.breakdown
    assert b["encoder_s"] > 0.1 * shared.step_time_s
    assert shared.step_time_s == pytest.approx(
        2 * (b["device_s"] + b["runtime_s"] + b["host_s"] + b["encoder_s"]) + b["sync_s"]
    )
    assert own.step_time_s < 0.6 * shared.step_time_s


def test_the_omni_encoders_collectives_wait_on_no_core():
    """Of the encoders' collectives (the handoff's and the weights' gradient all-reduce) only their CPU share
    (`link_cpu_share`) is work time-shared in rounds; the rest is waiting, as the LLM's collectives are."""
    workload = replace(paper_workload("A", 0.9), global_batch=16, cache={})
    eff = Efficiency(link_cpu_share=0.25)
    terms = PlanTerms.of(workload, replace(ROOMY, cores=2), ParallelPlan.parse("dp4+omni"), Options(1, True), eff, 4)
    times = omni_encoder_seconds(terms, 0.0)
    assert times.links > times.handoff > 0  # the weights' all-reduce is counted among the collectives
    waiting = 0.75 * times.links
    expected = 2 * (times.exposed - waiting) + waiting  # four ranks on two cores: two rounds of the work
    assert shared_encoder_seconds(terms, times.exposed, times.links) == pytest.approx(expected)
