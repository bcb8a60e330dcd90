"""Pipeline parallelism: the split (a balanced partition of the layers that keeps parameter names) and the
runner, whose loss statistics, aux loss and every parameter's gradient must equal the single-process gradient
accumulation over the same micro-batches, for 1F1B, GPipe and interleaved 1F1B, dense and MoE, plain chunks and
chunks wrapped by FSDP2."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed as dist

from omni_core.common.loss import token_loss_sums
from omni_core.common.plan import ParallelPlan, PlanError
from omni_core.models.flops import llm_block_matmul_params
from omni_core.models.omni import OmniModel, build_model
from omni_core.parallel.pipeline import (
    STATS_SIZE,
    PipelineRunner,
    balance_layers,
    layer_costs,
    pipeline_split,
    stage_ids,
)
from omni_core.runtime.ranks import run_ranks
from tests.test_models import N_MELS, PATCH_SIZE, make_batch

# Four micro-batches of 48 tokens: images and audio, none at all (the encoders' dummy path), one kind only.
MICRO_DOCS = [
    [[("text", 5), ("image", (2, 3)), ("text", 4)], [("audio", 16), ("text", 6), ("image", (3, 2))], [("text", 13)]],
    [[("text", 20)], [("text", 28)]],
    [[("text", 7), ("audio", 8), ("text", 3)], [("image", (4, 4)), ("text", 18)]],
    [[("audio", 20), ("text", 10)], [("text", 28)]],
]
# (flavor, schedule, virtual stages, compute dtype)
CASES = [
    ("debug", "1F1B", 1, torch.float32),
    ("debug", "GPipe", 1, torch.float32),
    ("debug", "Interleaved1F1B", 2, torch.float32),
    ("debug-moe", "1F1B", 1, torch.float32),
    ("debug-moe", "Interleaved1F1B", 2, torch.float32),
    ("debug", "1F1B", 1, torch.bfloat16),
]


def make_model(flavor: str) -> OmniModel:
    return build_model(flavor, patch_size=PATCH_SIZE, n_mels=N_MELS, seed=0)


def micro_batches():
    return [make_batch(docs, seed=i) for i, docs in enumerate(MICRO_DOCS)]


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


# --- the runner against single-process gradient accumulation ---------------------------------------------


def step_inputs(batches) -> tuple[float, float]:
    """(global targets, aux scale) as the trainer computes them on one data-parallel replica."""
    return float(sum(b.num_loss_tokens for b in batches)), 1.0 / len(batches)


def reference(flavor: str, dtype: torch.dtype) -> tuple[torch.Tensor, float, dict[str, torch.Tensor | None]]:
    """The unpipelined model, gradient accumulation with the trainer's loss."""
    model = make_model(flavor)
    batches = micro_batches()
    targets, aux_scale = step_inputs(batches)
    stats, aux_total = torch.zeros(STATS_SIZE, dtype=torch.float64), 0.0
    for batch in batches:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits = model(batch)
        sums = token_loss_sums(logits, batch)
        aux = model.aux_loss * aux_scale
        (sums.total / targets + aux).backward()
        stats += sums.stats()
        aux_total += float(aux.detach())
    return stats, aux_total, {n: p.grad for n, p in model.named_parameters()}


def pipelined(rank: int, world: int) -> list[tuple[torch.Tensor, float, dict[str, torch.Tensor | None]]]:
    """Every case on this pp rank: (loss stats, aux total, gradients of this rank's parameters)."""
    results = []
    for flavor, schedule, virtual, dtype in CASES:
        plan = ParallelPlan(pp=world, pp_schedule=schedule, virtual_stages=virtual)
        chunks = pipeline_split(make_model(flavor), plan, rank)
        batches = micro_batches()
        runner = PipelineRunner(chunks, plan, dist.group.WORLD, rank, torch.device("cpu"), len(batches))
        targets, aux_scale = step_inputs(batches)
        stats, aux_total = runner.forward_backward(batches, targets, dtype, aux_scale)
        grads = {n: p.grad for chunk in chunks for n, p in chunk.named_parameters()}
        results.append((stats, aux_total, grads))
    return results


@pytest.mark.slow
def test_pipeline_matches_gradient_accumulation() -> None:
    ranks = run_ranks(pipelined, 2)
    references = {(flavor, dtype): reference(flavor, dtype) for flavor, _, _, dtype in CASES}
    for case, (first, last) in zip(CASES, zip(*ranks, strict=True), strict=True):
        flavor, _, _, dtype = case
        ref_stats, ref_aux, ref_grads = references[(flavor, dtype)]
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.equal(first[0], torch.zeros(STATS_SIZE, dtype=torch.float64)), case
        assert torch.allclose(last[0], ref_stats, rtol=1e-6, atol=1e-4), (case, last[0], ref_stats)
        assert first[1] + last[1] == pytest.approx(ref_aux, abs=1e-6), case
        if flavor == "debug-moe":
            assert first[1] > 0 and last[1] > 0, case
        grads = {**first[2], **last[2]}
        assert sorted(grads) == sorted(ref_grads) and not set(first[2]) & set(last[2]), case
        for name, ref in ref_grads.items():
            assert ref is not None and grads[name] is not None, (case, name)
            assert (grads[name] - ref).abs().max() <= tol * max(1.0, ref.abs().max()), (case, name)
        assert any(n.startswith(("vision.", "audio.")) for n in first[2])  # encoders compared on stage 0


def pipelined_fsdp(rank: int, world: int) -> list[tuple[torch.Tensor, float, dict[str, torch.Tensor]]]:
    """pp2 x dp2, interleaved MoE, chunks wrapped by FSDP2 (blocks, encoders, projectors, then the chunk as
    root) before the runner is built, as the integrator does; both dp ranks see the same micro-batches, so
    FSDP's averaged gradients equal the single-process ones. Two steps: the second reuses the inferred shapes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh.get_local_rank("pp")
    plan = ParallelPlan(pp=2, dp_shard=2, pp_schedule="Interleaved1F1B", virtual_stages=2)
    chunks = pipeline_split(make_model("debug-moe"), plan, pp_rank)
    for chunk in chunks:
        parts = [*chunk.llm.layers.values()]
        if chunk.vision is not None:
            parts += [chunk.vision, chunk.audio, *chunk.projectors.values()]
        for part in [*parts, chunk]:
            fully_shard(part, mesh=mesh["dp"])
    batches = micro_batches()
    runner = PipelineRunner(chunks, plan, mesh.get_group("pp"), pp_rank, torch.device("cpu"), len(batches))
    targets, aux_scale = step_inputs(batches)
    steps = []
    for _ in range(2):
        for chunk in chunks:
            chunk.zero_grad()
        stats, aux_total = runner.forward_backward(batches, targets, torch.float32, aux_scale)
        steps.append((stats, aux_total, {n: p.grad.full_tensor() for c in chunks for n, p in c.named_parameters()}))
    return steps


@pytest.mark.slow
def test_pipeline_with_fsdp_chunks() -> None:
    ranks = run_ranks(pipelined_fsdp, 4)  # ranks 0, 1: pp stage 0 (dp 0, 1); ranks 2, 3: pp stage 1
    ref_stats, ref_aux, ref_grads = reference("debug-moe", torch.float32)
    for step in range(2):
        first, last = ranks[0][step], ranks[2][step]
        assert torch.allclose(last[0], ref_stats, rtol=1e-6, atol=1e-4)
        assert first[1] + last[1] == pytest.approx(ref_aux, abs=1e-6)
        grads = {**first[2], **last[2]}
        assert sorted(grads) == sorted(ref_grads)
        for name, ref in ref_grads.items():
            assert (grads[name] - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max()), (step, name)
