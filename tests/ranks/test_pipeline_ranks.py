"""Pipeline parallelism: the split (a balanced partition of the layers that keeps parameter names) and the
runner, whose loss statistics, aux loss and every parameter's gradient must equal the single-process gradient
accumulation over the same micro-batches, for 1F1B, GPipe and interleaved 1F1B, dense and MoE, plain chunks and
chunks wrapped by FSDP2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omni_core.common.loss import token_loss_sums
from omni_core.common.plan import ParallelPlan
from omni_core.common.loss import STATS_SIZE
from omni_core.parallel.pipeline import PipelineRunner, pipeline_split
from omni_core.runtime.ranks import run_ranks
from tests.helpers.pipeline import make_model, micro_batches

# (flavor, schedule, virtual stages, compute dtype)
CASES = [
    ("debug", "1F1B", 1, torch.float32),
    ("debug", "GPipe", 1, torch.float32),
    ("debug", "Interleaved1F1B", 2, torch.float32),
    ("debug-moe", "1F1B", 1, torch.float32),
    ("debug-moe", "Interleaved1F1B", 2, torch.float32),
    ("debug", "1F1B", 1, torch.bfloat16),
]


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
        stats, aux_total = runner.forward_backward(batches, torch.tensor(targets), dtype, aux_scale)
        grads = {n: p.grad for chunk in chunks for n, p in chunk.named_parameters()}
        results.append((stats, float(aux_total), grads))
    return results


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
        stats, aux_total = runner.forward_backward(batches, torch.tensor(targets), torch.float32, aux_scale)
        grads = {n: p.grad.full_tensor() for c in chunks for n, p in c.named_parameters()}
        steps.append((stats, float(aux_total), grads))
    return steps


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
