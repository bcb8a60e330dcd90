"""Attention in benchmarks/gpu_check.py: every path of `attention_timings.IMPLEMENTATIONS` (the models' packed
attention and its alternatives) in bf16 against the masked matmul in fp32, forward and backward, and the models'
paths timed on packed documents of mean length 512. A path that cannot run on the CPU (flex's backward,
FlashAttention's varlen kernel) is a named skip in a dry run and an error on a GPU."""

from __future__ import annotations

from typing import Any

import torch

# omni-1b's attention: 16 query heads of 128 over 8 KV heads; the dry run's is the debug flavor's.
GPU_SHAPE = {"tokens": 4096, "heads": 16, "kv_heads": 8, "head_dim": 128}
DRY_SHAPE = {"tokens": 384, "heads": 4, "kv_heads": 2, "head_dim": 32}
# bf16 keeps 8 bits of mantissa: its attention differs from fp32's by about 1% of the output's scale
BF16_TOLERANCE = 3e-2


def attention_parity(ctx) -> dict[str, Any]:
    from attention_timings import IMPLEMENTATIONS, packed_lengths  # a sibling script, not a package

    from omni_core.models.documents import PackedDocuments

    shape = DRY_SHAPE if ctx.dry_run else GPU_SHAPE
    lengths = packed_lengths(shape["tokens"], shape["tokens"] // 8, seed=1)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    docs = PackedDocuments(tuple(offsets.tolist()), device_offsets=offsets.to(ctx.device, torch.int32))
    report: dict[str, Any] = {"shape": shape, "doc_lengths": lengths, "dtype": "bfloat16", "paths": {}}
    failed = []
    for causal in (True, False):
        q, k, v, grad = inputs(shape, ctx.device)
        reference = forward_backward(IMPLEMENTATIONS["masked_matmul"], (q, k, v), grad, docs, causal)
        for name, path in IMPLEMENTATIONS.items():
            key = f"{name}_{'causal' if causal else 'bidirectional'}"
            report["paths"][key] = result = compare(path, (q, k, v), grad, docs, causal, reference, ctx)
            if result["status"] == "error":
                failed.append(key)
    if failed:
        report.update(status="error", error=f"paths off the fp32 reference or failing: {', '.join(failed)}")
    return report


def inputs(shape: dict[str, int], device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    t, h, kv, d = shape["tokens"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    q, grad = (torch.randn(t, h, d, generator=gen).to(device) for _ in range(2))
    k, v = (torch.randn(t, kv, d, generator=gen).to(device) for _ in range(2))
    return q, k, v, grad


def forward_backward(path, qkv, grad, docs, causal: bool, dtype=torch.float32) -> list[torch.Tensor]:
    """The output and the gradients of q, k and v, in fp32 for comparison."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in qkv]
    out = path(*leaves, docs, causal)
    out.backward(grad.to(dtype))
    return [t.float() for t in (out.detach(), *(leaf.grad for leaf in leaves))]


def compare(path, qkv, grad, docs, causal: bool, reference, ctx) -> dict[str, Any]:
    """The path's largest error in bf16 against the fp32 reference, relative to each tensor's scale."""
    try:
        got = forward_backward(path, qkv, grad, docs, causal, torch.bfloat16)
    except (NotImplementedError, RuntimeError) as error:
        status = "skipped" if ctx.dry_run else "error"
        return {"status": status, "reason": f"{type(error).__name__}: {str(error)[:300]}"}
    errors = {
        name: float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, reference, strict=True)
    }
    worst = max(errors.values())
    return {
        "status": "ok" if worst <= BF16_TOLERANCE else "error",
        "relative_error": errors,
        "tolerance": BF16_TOLERANCE,
    }


def attention_timings(ctx) -> dict[str, Any]:
    """`attention_timings.time_attention_paths`: the models' paths on packed documents of mean length 512 (64 at
    the dry run's small heads), with the speed-up of FlashAttention's varlen kernel over the per-document loop.
    The paths the device cannot run are named skips."""
    from attention_timings import time_attention_paths  # a sibling script, not a package
    from gpu_check_measures import skipped as skipped_part

    if ctx.dry_run:
        heads = {key: DRY_SHAPE[key] for key in ("heads", "kv_heads", "head_dim")}
        report = time_attention_paths(ctx.device, torch.float32, 512, 64, repeats=2, **heads)
    else:
        report = time_attention_paths(ctx.device, torch.bfloat16, 8192, 512)
    skipped = report.pop("skipped", {})
    report["paths_skipped"] = {name: skipped_part(why) for name, why in skipped.items()}
    return report
