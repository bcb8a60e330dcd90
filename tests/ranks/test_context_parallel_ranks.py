"""Context-parallel attention (omni_core/parallel/context.py) against single-process `varlen_attention`.

Each rank computes the full-sequence reference itself (same seed) and compares output and q/k/v gradients on
its own tokens; the multi-rank checks are batched into one launch per world size (forking costs ~1 s).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from omni_core.models.attention import varlen_attention
from omni_core.models.documents import PackedDocuments
from omni_core.parallel.context import ContextParallelAttention, cp_token_index
from omni_core.runtime.ranks import run_ranks

TOKENS, HEAD_DIM = 32, 8
# Uneven documents: a 1-token one (5) and ones crossing the chunk boundaries of cp=2 (8, 16, 24) and cp=4.
OFFSETS = [0, 5, 6, 19, 32]


def _case_errors(group, kind, causal, n_heads, n_kv_heads, dtype=torch.float32, padding=(), **options):
    """Max abs differences of output and q/k/v gradients on this rank's tokens, against the reference.
    `padding`: documents made of padding alone (no query of theirs sees a key: their rows are 0)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(TOKENS, n_heads, HEAD_DIM, generator=generator)
    k, v = (torch.randn(TOKENS, n_kv_heads, HEAD_DIM, generator=generator) for _ in range(2))
    grad = torch.randn(TOKENS, n_heads, HEAD_DIM, generator=generator)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    documents = PackedDocuments(tuple(OFFSETS), frozenset(padding))
    reference = varlen_attention(*full, documents, causal)
    reference.backward(grad)

    index = cp_token_index(TOKENS, dist.get_world_size(group), dist.get_rank(group), kind)
    local = [x[index].to(dtype).requires_grad_() for x in (q, k, v)]
    attend = ContextParallelAttention(kind, group, TOKENS, **options)
    out = attend(*local, documents if padding else torch.tensor(OFFSETS) if kind == "ring" else OFFSETS, causal)
    out.backward(grad[index].to(dtype))
    assert out.dtype == dtype and all(x.grad.dtype == dtype for x in local)
    pairs = [(out, reference)] + [(x.grad, y.grad) for x, y in zip(local, full)]
    return {name: (a.float() - b[index]).abs().max().item() for name, (a, b) in zip(("out", "dq", "dk", "dv"), pairs)}


def _cp2_checks(rank, world):
    group = dist.group.WORLD
    results = {
        f"{kind} causal={causal}": _case_errors(group, kind, causal, 4, 2)
        for kind in ("ulysses", "ring") for causal in (True, False)
    }
    results["ring MHA tiles of 3"] = _case_errors(group, "ring", True, 4, 4, block_size=3)
    results["ring bfloat16"] = _case_errors(group, "ring", True, 4, 2, dtype=torch.bfloat16)
    for kind in ("ring", "ulysses"):  # a 1-token padding document and one across the chunks
        results[f"{kind} padding"] = _case_errors(group, kind, True, 4, 2, padding=(1, 3), block_size=3)
    try:
        ContextParallelAttention("ulysses", dist.group.WORLD, TOKENS)(
            *(torch.zeros(TOKENS // world, 3, HEAD_DIM) for _ in range(3)), OFFSETS, True)
    except ValueError as error:
        results["3 heads"] = str(error)
    return results


def _cp4_checks(rank, world):
    group = dist.group.WORLD
    # CP groups {0, 1} and {2, 3}, as a (dp, cp) mesh makes them: ring peers are group ranks, not global ones.
    subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return {
        "ring causal": _case_errors(group, "ring", True, 4, 2),
        "ring non-causal tiles of 3": _case_errors(group, "ring", False, 4, 2, block_size=3),
        "ulysses 2 KV heads": _case_errors(group, "ulysses", True, 4, 2),
        "ring cp2 subgroup": _case_errors(subgroups[rank // 2], "ring", True, 4, 2),
    }


def _assert_close(results, tolerance=1e-5):
    for rank, cases in enumerate(results):
        for case, errors in cases.items():
            limit = 3e-2 if "bfloat16" in case else tolerance
            assert all(error < limit for error in errors.values()), f"rank {rank}, {case}: {errors}"  # NaN fails


def test_context_parallel_matches_reference_cp2():
    results = run_ranks(_cp2_checks, 2)
    assert all("3 heads do not divide by cp=2" in cases.pop("3 heads") for cases in results)
    _assert_close(results)


def test_context_parallel_matches_reference_cp4():
    _assert_close(run_ranks(_cp4_checks, 4))
