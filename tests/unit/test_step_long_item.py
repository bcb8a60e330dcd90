"""A step's longest encoder item, expected over steps (`encoders.step_long_item_seconds`), and the busiest
rank of unbalanced `coupled` loaders paying its whole work (`ExtraWork.stage_imbalance`)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from omni_core.common.catalog import GpuCatalog
from omni_core.common.plan import EncoderPlan, ParallelPlan
from omni_core.data.profile import profile_dataset
from omni_core.estimator.cost import Options, estimate_step
from omni_core.estimator.encoders import long_item_seconds, step_long_item_seconds
from omni_core.estimator.recipe_cells import flavor_workload
from tests.helpers.recipes import build_recipe

# few large images among long text documents: most steps hold no image, a few hold one
RARE_LARGE = {
    "experiment.name": "rare-large", "data.source": "dynamic", "data.seq_len": 1024, "data.max_image_patches": 1024,
    "data.synthetic.num_samples": 400, "data.synthetic.mix": {"text": 0.9, "image": 0.1},
    "data.synthetic.image_side_px": {"min": 112, "max": 448}, "data.synthetic.text_tokens": {"min": 100, "max": 400},
    "model.flavor": "debug-enc", "parallel.nproc": 2,
}  # fmt: skip


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    root = tmp_path_factory.mktemp("rare")
    recipe = build_recipe(root / "out", RARE_LARGE)
    profile, _ = profile_dataset(recipe, root / "profile", draw=False)
    return flavor_workload(recipe, "debug-enc", 2, profile)


def step_s(workload, batch: int | None = None) -> float:
    batch = workload.global_batch if batch is None else batch
    return step_long_item_seconds(replace(workload, global_batch=batch), None, 3.0, 1.0, EncoderPlan())


def test_only_the_steps_holding_a_long_item_wait_for_it(workload):
    longest = long_item_seconds(workload, None, 3.0, 1.0, 1)
    few, many = step_s(workload), step_s(workload, 100_000)
    assert len(workload.items.lengths) > 3 and few < 0.5 * longest
    assert few < many <= longest and many > 0.8 * longest  # every step holds one of the longest bin
    unprofiled = replace(workload, items=replace(workload.items, lengths=()))
    assert step_s(unprofiled) == longest  # a drawn step: its own longest


def test_the_expected_longest_of_a_poisson_count_of_items(workload):
    items = replace(workload.items, lengths=((1.0, 0.5), (2.0, 0.5)), quad=0.0)
    two = replace(workload, items=items)
    n = items.count * two.global_batch
    short, long = items.work, 2 * items.work  # per_sample 1 s: seconds are works
    expected = short * (1 - math.exp(-n)) + (long - short) * (1 - math.exp(-n / 2))
    assert step_s(two) == pytest.approx(expected)


def test_unbalanced_loaders_leave_the_busiest_rank_more_of_its_llm_work_too(workload):
    gpu, plan = GpuCatalog()["cpu"], ParallelPlan.parse("dp2z1")

    def pipeline_s(imbalance: float) -> float:
        est = estimate_step(replace(workload, loader_imbalance=imbalance), gpu, plan, Options(1), gpus_per_node=2)
        return est.breakdown["pipeline_s"]

    even, uneven = pipeline_s(1.0), pipeline_s(1.5)
    assert 0.35 * even < uneven - even <= 0.5 * even  # the LLM's and the encoders' compute, not the encoders' alone
