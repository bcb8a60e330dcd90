"""Greedy generation with the KV cache (`runtime.generate.greedy_generate`) against the full recompute evaluation
used before it (`greedy_recompute`: the whole model, encoders included, once per new token, one prompt at a time),
at NEW_TOKENS new tokens after image prompts of about PROMPT_TOKENS tokens.

    python benchmarks/generation_bench.py [--quick] [--device cpu|cuda] --out generation.json

The LLM has Qwen2-0.5B's shape (dim 896, 24 layers, 14 query and 2 KV heads, FFN 4864, vocabulary 151936) with
the debug flavor's encoders, weights drawn from a seed: speed does not depend on the values. `--quick` keeps its
width and vocabulary but 2 layers (about a minute and a half on 2 CPU cores). No stop token: every prompt decodes exactly
NEW_TOKENS tokens. Keys: `gen_tokens_per_s_recompute` (one prompt at a time, as before), `gen_tokens_per_s_cached`
(BATCH prompts decoded together, as evaluation does with eval.batch_size), `gen_tokens_per_s_cached_batch1`, and
`speedup` = cached / recompute. Times are medians over ROUNDS rounds (1 with `--quick`) after a
warm-up; the report records the load average. This file holds the generation figures of the issue's pretrained
benchmark and is importable from it (`generation_figures`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_core.common.tokenizer import BYTE_TOKENIZER, IMAGE_ID
from omni_core.models.omni import OmniModel, build_model
from omni_core.runtime.generate import Document, greedy_generate, greedy_recompute

NEW_TOKENS = 64
PROMPT_TOKENS = 128  # of which IMAGE_TOKENS are an image's
IMAGE_TOKENS = 16
BATCH = 8
ROUNDS = 3
QWEN2_05B = {"dim": 896, "n_layers": 24, "n_heads": 14, "n_kv_heads": 2, "ffn_hidden": 4864, "vocab_size": 151936}


def bench_model(quick: bool, device: torch.device) -> OmniModel:
    args = build_model("debug", patch_size=8, n_mels=32, seed=0).args
    shape = QWEN2_05B | ({"n_layers": 2} if quick else {})
    model = OmniModel(dataclasses.replace(args, llm=dataclasses.replace(args.llm, qkv_bias=True, **shape)))
    model.init_weights(0)
    return model.to(device).eval()


def prompts(count: int, patch_dim: int) -> list[Document]:
    """Image prompts of PROMPT_TOKENS - i tokens (different lengths, as held-out documents have)."""
    gen = torch.Generator().manual_seed(0)
    docs = []
    for i in range(count):
        text = torch.randint(0, 256, (PROMPT_TOKENS - IMAGE_TOKENS - i,), generator=gen)
        ids = torch.cat([torch.full((IMAGE_TOKENS,), IMAGE_ID), text])
        patches = torch.randn(IMAGE_TOKENS, patch_dim, generator=gen)
        empty = torch.zeros(0, dtype=torch.long)
        docs.append(
            Document(
                "image", ids, torch.full_like(ids, -100), patches, torch.tensor([[4, 4]]),
                torch.zeros(0, 32), empty, torch.zeros(0, patch_dim), empty.view(0, 3),
            )
        )  # fmt: skip
    return docs


def timed(fn, rounds: int):
    """(median seconds of fn over `rounds` rounds after a warm-up, the warm-up's result)."""
    result = fn()
    times = []
    for _ in range(rounds):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def generation_figures(quick: bool, device: torch.device) -> dict:
    model = bench_model(quick, device)
    docs = prompts(BATCH, model.args.vision.patch_dim)
    batch = [doc.with_tokens(doc.input_ids, BYTE_TOKENIZER) for doc in docs]
    none: frozenset[int] = frozenset()
    start, rounds = len(docs[0].input_ids), 1 if quick else ROUNDS
    recompute_s, recomputed = timed(
        lambda: greedy_recompute(model, docs[0], start, NEW_TOKENS, none, BYTE_TOKENIZER), rounds
    )
    batch1_s, cached = timed(lambda: greedy_generate(model, batch[:1], [NEW_TOKENS], none), rounds)
    batched_s, _ = timed(lambda: greedy_generate(model, batch, [NEW_TOKENS] * BATCH, none), rounds)
    figures = {
        "gen_tokens_per_s_recompute": NEW_TOKENS / recompute_s,
        "gen_tokens_per_s_cached_batch1": NEW_TOKENS / batch1_s,
        "gen_tokens_per_s_cached": BATCH * NEW_TOKENS / batched_s,
        "same_tokens": cached[0] == recomputed,  # greedy ties aside, the cache changes nothing
    }
    figures["speedup"] = figures["gen_tokens_per_s_cached"] / figures["gen_tokens_per_s_recompute"]
    figures["speedup_batch1"] = figures["gen_tokens_per_s_cached_batch1"] / figures["gen_tokens_per_s_recompute"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report: dict = {"quick": args.quick, "device": args.device, "load_average_start": os.getloadavg()[0]}
    report["new_tokens"], report["prompt_tokens"], report["batch"] = NEW_TOKENS, PROMPT_TOKENS, BATCH
    start = time.perf_counter()
    report |= generation_figures(args.quick, torch.device(args.device))
    report["seconds"], report["load_average_end"] = time.perf_counter() - start, os.getloadavg()[0]
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
