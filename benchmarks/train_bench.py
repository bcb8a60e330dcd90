"""Single-job training throughput per model flavor, and attention implementations side by side.

For each flavor that fits the device (`debug`, `small`): tokens/s, MFU and peak memory of a short
single-rank training run on generated data (bf16 autocast on GPUs that support it, float32 on CPU), then
the attention timings of `benchmarks/attention_timings.py` at 4k packed tokens, then `long_context`: the
debug flavor's peak memory and tokens/s at LONG_SEQ packed tokens per sequence, each in a fresh process, on
long text documents drawn on the fly (a third to nine tenths of seq_len each: one document and its padding
a sequence, where attention memory would grow with the square of the length), and how much of the peak
grows per doubling of seq_len once the same run at BASE_SEQ tokens (parameters, optimizer state, the
runtime) is taken off: linear growth is 2x per doubling, quadratic 4x. Runs unchanged on CPU and on one CUDA GPU.

    python benchmarks/train_bench.py [--quick] --out report.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_timings import time_attention  # noqa: E402 - a sibling script, not a package

from omni_core.recipe.schema import Recipe  # noqa: E402
from omni_core.runtime.dist import DistInfo  # noqa: E402
from omni_core.runtime.trainer import train  # noqa: E402

FLAVORS = {"debug": {"seq_len": 512, "micro_batch": 1}, "small": {"seq_len": 1024, "micro_batch": 1}}
LONG_SEQ = (4096, 8192, 16384, 32768)
BASE_SEQ = 256
LONG_STEPS = 3


def bench_flavor(flavor: str, root: Path, steps: int, device: torch.device) -> dict[str, float]:
    shape = FLAVORS[flavor]
    recipe = Recipe.model_validate({
        "experiment": {"name": f"bench-{flavor}", "output_dir": str(root / "out")},
        "data": {"path": str(root / "data"), "synthetic": {"num_samples": 600}, **shape},
        "model": {"flavor": flavor},
        "train": {"steps": steps, "warmup_steps": 2, "log_every": steps, "ckpt_every": 0, "resume": False},
    })
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    result = train(recipe, info, log=lambda _: None)
    return {
        "tokens_per_s": result.tokens_per_s,
        "mfu_pct": result.mfu_pct,
        "mfu_peak": result.mfu_peak,
        "peak_mem_mb": result.peak_mem_mb,
        "steps": result.steps,
        "seq_len": shape["seq_len"],
        "final_loss": result.final_loss,
    }


def long_context_run(root: str, seq_len: int, steps: int) -> dict[str, float]:
    """One run in its own process, so that its peak memory is its own."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    recipe = Recipe.model_validate({
        "experiment": {"name": f"long-{seq_len}", "output_dir": f"{root}/out"},
        "data": {"source": "dynamic", "seq_len": seq_len, "micro_batch": 1,
                 "synthetic": {"num_samples": 1000, "mix": {"text": 1.0}, "long_doc_share": 0.0,
                               "text_tokens": {"min": seq_len // 3, "max": seq_len * 9 // 10}}},
        "model": {"flavor": "debug"},
        "train": {"steps": steps, "warmup_steps": 1, "log_every": steps, "ckpt_every": 0, "resume": False},
    })
    result = train(recipe, DistInfo(rank=0, world_size=1, local_rank=0, device=device), log=lambda _: None)
    return {"seq_len": seq_len, "peak_mem_mb": result.peak_mem_mb, "tokens_per_s": result.tokens_per_s}


def long_context(sizes: tuple[int, ...], steps: int) -> dict:
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq_len in (BASE_SEQ, *sizes):
            with spawn.Pool(1) as pool:
                runs.append(pool.apply(long_context_run, (tmp, seq_len, steps)))
    base, *long = runs
    for run in long:
        run["activation_mem_mb"] = run["peak_mem_mb"] - base["peak_mem_mb"]
    growth = [b["activation_mem_mb"] / a["activation_mem_mb"] for a, b in zip(long, long[1:])]
    return {"base": base, "runs": long, "growth_per_doubling": growth, "max_growth": max(growth, default=0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (well under 2 minutes on CPU)")
    parser.add_argument("--out", default="train_bench.json")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    steps = 4 if args.quick else 30
    started = time.perf_counter()
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "flavors": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for flavor in FLAVORS:
            try:
                report["flavors"][flavor] = bench_flavor(flavor, Path(tmp) / flavor, steps, device)
            except torch.OutOfMemoryError as err:
                report["flavors"][flavor] = {"skipped": f"out of memory: {err}"}
    report["attention"] = time_attention(tokens=4096, device=device, repeats=1 if args.quick else 5)
    report["long_context"] = long_context(LONG_SEQ[:2] if args.quick else LONG_SEQ, 2 if args.quick else LONG_STEPS)
    report["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
