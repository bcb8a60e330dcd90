"""Pipeline parallelism, the split: a balanced partition of the layers that keeps parameter names, whose chunks
compose to the whole model (the runner on ranks: tests/ranks/test_pipeline_ranks.py)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from omni_core.common.plan import ParallelPlan, PlanError
from omni_core.models.flops import llm_block_matmul_params
from omni_core.models.omni import OmniModel
from omni_core.parallel.pipeline import balance_layers, layer_costs, pipeline_split, stage_ids
from tests.helpers.pipeline import make_model, micro_batches


def all_chunks(model: OmniModel, plan: ParallelPlan) -> list[OmniModel]:
    """Every stage's chunk, in stage order, gathered over the pp ranks."""
    by_stage = {}
    for rank in range(plan.pp):
        by_stage.update(zip(stage_ids(plan, rank), pipeline_split(model, plan, rank), strict=True))
    return [by_stage[s] for s in sorted(by_stage)]


# --- the split ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", [ParallelPlan(pp=2), ParallelPlan.parse("dp1-pp2v2"), ParallelPlan(pp=4)])
def test_split_partitions_layers_and_keeps_names(plan: ParallelPlan) -> None:
    model = make_model("debug")
    chunks = all_chunks(model, plan)
    assert [k for c in chunks for k in c.llm.layers] == list(model.llm.layers)  # in order, each once
    assert all(len(c.llm.layers) >= 1 for c in chunks)
    whole = dict(model.named_parameters())
    names = [n for c in chunks for n, _ in c.named_parameters()]
    assert sorted(names) == sorted(whole)  # a partition of the parameters, under the whole model's names
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            assert torch.equal(param, whole[name])
    first, *rest = chunks
    assert first.vision is not None and first.audio is not None and first.llm.tok_embeddings is not None
    assert all(c.vision is None and c.audio is None and c.projectors is None and c.llm.tok_embeddings is None
               for c in rest)
    assert chunks[-1].llm.output is not None and all(c.llm.norm is None and c.llm.output is None
                                                     for c in chunks[:-1])


@pytest.mark.parametrize("flavor", ["debug", "debug-moe"])
def test_chunks_compose_to_the_whole_model(flavor: str) -> None:
    model = make_model(flavor)
    chunks = all_chunks(model, ParallelPlan.parse("dp1-pp2v2"))
    batch = micro_batches()[0]
    hidden = None
    for chunk in chunks:
        hidden = chunk(batch, hidden)
    assert torch.equal(hidden, model(batch))
    assert torch.allclose(sum(c.aux_loss for c in chunks), model.aux_loss, atol=1e-6)


def test_layer_costs_count_the_head_as_a_fraction_of_a_block() -> None:
    args = make_model("debug").args.llm
    head = args.dim * args.vocab_size / llm_block_matmul_params(args, active=True)
    assert 0 < head < 1
    assert layer_costs(args) == [1.0, 1.0, 1.0, 1.0 + head]
    assert balance_layers(layer_costs(args), 2) == [range(2), range(2, 4)]
    assert balance_layers([1, 1, 1, 1, 1.2], 2) == [range(3), range(3, 5)]  # the head's stage gets fewer
    assert balance_layers([1, 1, 1, 1, 1, 1, 1, 4], 4) == [range(2), range(2, 4), range(4, 7), range(7, 8)]


def split_key(costs: list[float], cuts: tuple[int, ...]) -> tuple:
    """What `balance_layers` minimises, in order: the costliest stage, the sum of squares, the stage costs."""
    stage_costs = [round(sum(costs[a:b]), 6) for a, b in itertools.pairwise([0, *cuts, len(costs)])]
    return max(stage_costs), round(sum(c * c for c in stage_costs), 6), stage_costs


def test_balance_is_the_most_even_min_max_split() -> None:
    """Against brute force over every split of up to 9 layers."""
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        costs = [rng.choice([1.0, 1.0, 1.0, 0.5, 2.0, 1.3]) for _ in range(n)]
        best = min(itertools.combinations(range(1, n), stages - 1), key=lambda cuts: split_key(costs, cuts))
        split = balance_layers(costs, stages)
        assert [r.start for r in split] == [0, *best] and split[-1].stop == n and all(split)


def test_refuses_more_stages_than_layers() -> None:
    model = make_model("debug")
    with pytest.raises(PlanError, match="6 pipeline stages for 4 LLM layers"):
        pipeline_split(model, ParallelPlan.parse("dp1-pp3v2"), 0)
    with pytest.raises(PlanError, match="5 pipeline stages"):
        balance_layers([1.0] * 4, 5)
