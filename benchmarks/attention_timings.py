"""Attention over packed documents, four ways, forward and forward+backward: SDPA per document (what the
models use), one SDPA call with a dense block-diagonal mask, a plain masked matmul, and flex_attention with a
block-sparse document mask (where it runs: it has no backward on CPU).

    python benchmarks/attention_timings.py [--tokens 4096] [--docs 8] [--device cuda] [--out report.json]

`time_attention` is imported by benchmarks/train_bench.py. Runs unchanged on CUDA.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence

import torch

from omni_core.models.attention import (
    block_mask_attention,
    flex_document_attention,
    masked_matmul_attention,
    varlen_attention,
)

IMPLEMENTATIONS = {
    "sdpa": varlen_attention,
    "sdpa_block_mask": block_mask_attention,
    "masked_matmul": masked_matmul_attention,
    "flex": flex_document_attention,
}


def _doc_lengths(tokens: int, docs: int | Sequence[int]) -> list[int]:
    if isinstance(docs, int):
        return [tokens // docs + (1 if i < tokens % docs else 0) for i in range(docs)]
    if sum(docs) != tokens:
        raise ValueError(f"document lengths {list(docs)} do not sum to {tokens} tokens")
    return list(docs)


def _time_ms(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median wall time of `fn` after one warm-up call (which also pays any compilation)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2]


def _forward(attention, q, k, v, cu_seqlens, causal) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            attention(q, k, v, cu_seqlens, causal)

    return run


def _forward_backward(attention, q, k, v, cu_seqlens, causal) -> Callable[[], None]:
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def run() -> None:
        attention(*leaves, cu_seqlens, causal).sum().backward()

    return run


def time_attention(
    tokens: int = 4096,
    heads: int = 8,
    head_dim: int = 64,
    docs: int | Sequence[int] = 8,
    device: str | torch.device = "cpu",
    causal: bool = True,
    dtype: torch.dtype | None = None,
    repeats: int = 3,
) -> dict:
    """Milliseconds per call for each implementation on the same packed q/k/v ([tokens, heads, head_dim]):
    `<name>_ms` forward+backward, `<name>_fwd_ms` forward only. An implementation that cannot run here gets
    None and `<name>_error` (the exception PyTorch raised), never an estimate."""
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    lengths = _doc_lengths(tokens, docs)
    cu_seqlens = [0]
    for n in lengths:
        cu_seqlens.append(cu_seqlens[-1] + n)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(tokens, heads, head_dim, generator=gen, device=device, dtype=dtype) for _ in range(3))
    report: dict = {"tokens": tokens, "heads": heads, "head_dim": head_dim, "doc_lengths": lengths,
                    "causal": causal, "device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    for name, attention in IMPLEMENTATIONS.items():
        try:
            report[f"{name}_fwd_ms"] = _time_ms(_forward(attention, q, k, v, cu_seqlens, causal), device, repeats)
            report[f"{name}_ms"] = _time_ms(_forward_backward(attention, q, k, v, cu_seqlens, causal), device, repeats)
        except Exception as error:  # noqa: BLE001 - reported, e.g. flex_attention's missing CPU backward
            report.setdefault(f"{name}_fwd_ms", None)
            report[f"{name}_ms"] = None
            report[f"{name}_error"] = f"{type(error).__name__}: {error}"
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args()
    report = time_attention(args.tokens, args.heads, args.head_dim, args.docs, args.device, repeats=args.repeats)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
