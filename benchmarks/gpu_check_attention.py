"""Attention in benchmarks/gpu_check.py: every path of `attention_timings.IMPLEMENTATIONS` (the models' packed
attention and its alternatives) against an fp32 reference in bf16, forward and backward, and their timings on
packed documents of mean length 512. A path that cannot run on the CPU (flex's backward, FlashAttention's
varlen kernel) is a named skip in a dry run and an error on a GPU."""

from __future__ import annotations

from typing import Any

import torch

# omni-1b's attention: 16 query heads of 128 over 8 KV heads; the dry run's is the debug flavor's.
GPU_SHAPE = {"tokens": 4096, "heads": 16, "kv_heads": 8, "head_dim": 128}
DRY_SHAPE = {"tokens": 384, "heads": 4, "kv_heads": 2, "head_dim": 32}
# bf16 keeps 8 bits of mantissa: its attention differs from fp32's by about 1% of the output's scale
BF16_TOLERANCE = 3e-2


def packed_lengths(total: int, mean: int, seed: int = 0) -> list[int]:
    """Document lengths summing to `total`, exponentially spread around `mean` (many short, a few long, as
    packed web text), at least 8 tokens each."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        draw = max(8, int(torch.empty(1).exponential_(1 / mean, generator=gen)))
        lengths.append(min(draw, total - sum(lengths)))
    return lengths


def attention_parity(ctx) -> dict[str, Any]:
    from attention_timings import IMPLEMENTATIONS  # a sibling script, not a package

    shape = DRY_SHAPE if ctx.dry_run else GPU_SHAPE
    lengths = packed_lengths(shape["tokens"], shape["tokens"] // 8, seed=1)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    report: dict[str, Any] = {"shape": shape, "doc_lengths": lengths, "dtype": "bfloat16", "paths": {}}
    failed = []
    for causal in (True, False):
        q, k, v, grad = inputs(shape, ctx.device)
        reference = forward_backward(IMPLEMENTATIONS["masked_matmul"], (q, k, v), grad, cu_seqlens, causal)
        for name, path in IMPLEMENTATIONS.items():
            key = f"{name}_{'causal' if causal else 'bidirectional'}"
            report["paths"][key] = result = compare(path, (q, k, v), grad, cu_seqlens, causal, reference, ctx)
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


def forward_backward(path, qkv, grad, cu_seqlens, causal: bool, dtype=torch.float32) -> list[torch.Tensor]:
    """The output and the gradients of q, k and v, in fp32 for comparison."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in qkv]
    out = path(*leaves, cu_seqlens.to(qkv[0].device), causal)
    out.backward(grad.to(dtype))
    return [t.float() for t in (out.detach(), *(leaf.grad for leaf in leaves))]


def compare(path, qkv, grad, cu_seqlens, causal: bool, reference, ctx) -> dict[str, Any]:
    """The path's largest error in bf16 against the fp32 reference, relative to each tensor's scale."""
    try:
        got = forward_backward(path, qkv, grad, cu_seqlens, causal, torch.bfloat16)
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
    """Milliseconds of each path on packed documents of mean length 512 (64 in a dry run), with the speed-up
    of FlashAttention's varlen kernel over the per-document loop where both ran."""
    import attention_timings as timings  # a sibling script, not a package

    dtype = torch.float32 if ctx.dry_run else torch.bfloat16
    tokens, mean = (512, 64) if ctx.dry_run else (8192, 512)
    if hasattr(timings, "time_attention_paths"):
        report = timings.time_attention_paths(ctx.device, dtype, tokens, mean)
    else:
        shape = DRY_SHAPE if ctx.dry_run else GPU_SHAPE
        lengths = packed_lengths(tokens, mean)
        report = timings.time_attention(tokens, shape["heads"], shape["head_dim"], lengths, ctx.device, dtype=dtype)
        report["note"] = "attention_timings.time_attention_paths is not there: time_attention timed equal heads"
    report["mean_doc_len"] = mean
    loop, varlen = report.get("sdpa_ms"), report.get("varlen_ms")
    report["varlen_speedup_over_loop"] = loop / varlen if loop and varlen else None
    return report
