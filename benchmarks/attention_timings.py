"""Attention over packed documents, forward and forward+backward, every way omni has: SDPA per document (the
models' path on CPU), FlashAttention over all documents in one call (`varlen`, the models' path on CUDA),
flex_attention with a block-sparse document mask, and two dense baselines (one SDPA call with a block-diagonal
mask, a plain masked matmul).

    python benchmarks/attention_timings.py [--tokens 4096] [--docs 8] [--device cuda] [--out report.json]
    python benchmarks/attention_timings.py --paths --tokens 8192 --mean-doc-len 512 [--device cuda]

`time_attention` is imported by benchmarks/train_bench.py; `time_attention_paths` (the models' three paths on
packed documents of a mean length, omni-1b's heads) by benchmarks/gpu_check.py. Runs unchanged on CUDA.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence

import torch

from omni_core.models.attention import (
    block_mask_attention,
    flash_varlen_attention,
    flex_document_attention,
    masked_matmul_attention,
    resolve_attention,
    sdpa_document_attention,
)
from omni_core.models.documents import PackedDocuments

IMPLEMENTATIONS = {
    "sdpa": sdpa_document_attention,
    "varlen": flash_varlen_attention,
    "flex": flex_document_attention,
    "sdpa_block_mask": block_mask_attention,
    "masked_matmul": masked_matmul_attention,
}
PATHS = ("sdpa", "varlen", "flex")  # the models' (`model.attention`)


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


def _forward(attention, q, k, v, docs, causal) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            attention(q, k, v, docs, causal)

    return run


def _forward_backward(attention, q, k, v, docs, causal) -> Callable[[], None]:
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def run() -> None:
        attention(*leaves, docs, causal).sum().backward()

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
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(tokens, heads, head_dim, generator=gen, device=device, dtype=dtype) for _ in range(3))
    report: dict = {"tokens": tokens, "heads": heads, "head_dim": head_dim, "doc_lengths": lengths,
                    "causal": causal, "device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    _time_paths(report, IMPLEMENTATIONS, (q, k, v), _documents(lengths, device), causal, device, repeats)
    return report


def time_attention_paths(
    device: str | torch.device,
    dtype: torch.dtype,
    total_tokens: int,
    mean_doc_len: int,
    *,
    heads: int = 16,
    kv_heads: int = 8,
    head_dim: int = 128,
    repeats: int = 5,
) -> dict:
    """Milliseconds per causal call of the models' paths (`<path>_ms` forward+backward, `<path>_fwd_ms`) on
    `total_tokens` packed into documents of mean length `mean_doc_len` (exponentially spread, as packed text),
    with omni-1b's grouped-query heads by default, and `varlen_speedup_over_loop`. Only the paths the device runs
    are timed (varlen: CUDA in bf16/fp16; flex: CUDA); the others are listed under `skipped` with the reason."""
    device = torch.device(device)
    lengths = packed_lengths(total_tokens, mean_doc_len)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(total_tokens, heads, head_dim, generator=gen, device=device, dtype=dtype)
    k, v = (torch.randn(total_tokens, kv_heads, head_dim, generator=gen, device=device, dtype=dtype) for _ in range(2))
    skipped = {}
    if resolve_attention("auto", q) != "varlen":
        skipped["varlen"] = "FlashAttention's varlen kernel needs CUDA, bf16 or fp16 and torch.nn.attention.varlen"
    if device.type != "cuda":
        skipped["flex"] = "flex_attention has no backward here (and is compiled on CUDA only)"
    paths = {name: IMPLEMENTATIONS[name] for name in PATHS if name not in skipped}
    report: dict = {"tokens": total_tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                    "mean_doc_len": mean_doc_len, "documents": len(lengths), "longest_doc": max(lengths),
                    "device": str(device), "dtype": str(dtype).removeprefix("torch."), "skipped": skipped}
    _time_paths(report, paths, (q, k, v), _documents(lengths, device), True, device, repeats)
    loop, varlen = report.get("sdpa_ms"), report.get("varlen_ms")
    report["varlen_speedup_over_loop"] = loop / varlen if loop and varlen else None
    return report


def packed_lengths(total: int, mean: int, seed: int = 0) -> list[int]:
    """Document lengths summing to `total`, exponentially spread around `mean` (many short, a few long), at
    least 16 tokens each but for the last, which fills the pack."""
    gen = torch.Generator().manual_seed(seed)
    draws = torch.empty(2 * total // mean + 8).exponential_(1 / mean, generator=gen).clamp(min=16).long()
    ends = [end for end in draws.cumsum(0).tolist() if end < total]
    return [b - a for a, b in zip([0, *ends], [*ends, total])]


def _documents(lengths: Sequence[int], device: torch.device) -> PackedDocuments:
    """The packed layout, its offsets also on the device (as a batch brings them): built once, outside the timing."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return PackedDocuments(tuple(offsets), device_offsets=torch.tensor(offsets, dtype=torch.int32, device=device))


def _time_paths(report: dict, paths: dict, qkv, docs: PackedDocuments, causal: bool, device, repeats: int) -> None:
    """`<name>_fwd_ms` and `<name>_ms` of each path into `report`. A path that cannot run here gets None and
    `<name>_error` (the exception PyTorch raised), never an estimate."""
    for name, attention in paths.items():
        try:
            report[f"{name}_fwd_ms"] = _time_ms(_forward(attention, *qkv, docs, causal), device, repeats)
            report[f"{name}_ms"] = _time_ms(_forward_backward(attention, *qkv, docs, causal), device, repeats)
        except Exception as error:  # noqa: BLE001 - reported, e.g. flex_attention's missing CPU backward
            report.setdefault(f"{name}_fwd_ms", None)
            report[f"{name}_ms"] = None
            report[f"{name}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", action="store_true", help="time the models' paths (time_attention_paths)")
    parser.add_argument("--mean-doc-len", type=int, default=512, help="with --paths")
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args()
    if args.paths:
        dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
        report = time_attention_paths(args.device, dtype, args.tokens, args.mean_doc_len, repeats=args.repeats)
    else:
        report = time_attention(args.tokens, args.heads, args.head_dim, args.docs, args.device, repeats=args.repeats)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
