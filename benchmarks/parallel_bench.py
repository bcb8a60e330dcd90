"""Throughput and memory of every 5D plan the tests cover, measured side by side in one run.

Each plan trains a few optimizer steps through the real `train_step` on freshly forked ranks (gloo on CPU;
nccl with one GPU per rank when CUDA is present, where worlds larger than the GPU count are skipped).
One launch per plan keeps each plan's peak memory its own. All plans of a flavor share one workload:
micro-batches of `seq_len` tokens per model replica (split further by tp and cp inside the replica's rank
group) and the same global batch per step, so a dp-way plan accumulates `global_batch / dp` micro-batches.
`ratio_to_world1` compares each plan's tokens/s with one process running the same workload; each plan's
figures are from its fastest round (the full run makes two).

World 1 is one single-threaded rank, so N ranks on C cores can at best reach min(N, C) times its throughput.
On a small CPU shared with other work the ratios mostly show what each dimension costs (collectives,
pipeline bubbles, encoders run again on every tp and cp rank), not how it scales.

    python benchmarks/parallel_bench.py [--quick] --out report.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omni_core.common.plan import ParallelPlan
from omni_core.data.dataset import open_dataset
from omni_core.data.loader import PackedLoader
from omni_core.data.synthetic import ensure_dataset
from omni_core.recipe.schema import Recipe
from omni_core.runtime.dist import DistInfo, process_group_backend, shutdown
from omni_core.runtime.perf import peak_memory_mb
from omni_core.runtime.ranks import preimport
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.plan_rules import resolve_plan
from omni_core.runtime.replica import build_replica
from omni_core.runtime.step import train_step
from omni_core.runtime.trainer import resolve_dtype

# (flavor, plan) in world order; each flavor's world-1 plan is the baseline of its ratios.
PLANS = [
    ("debug", "dp1"),
    ("debug-moe", "dp1"),
    ("debug", "dp2"),
    ("debug", "dp1-tp2"),
    ("debug", "dp1-pp2"),
    ("debug", "dp1-pp2v2"),
    ("debug", "dp1-cp2u"),
    ("debug", "dp1-cp2r"),
    ("debug-moe", "dp2-ep2"),
    ("debug", "dp4"),
    ("debug", "dp2x2"),
    ("debug", "dp2-tp2"),
    ("debug", "dp2-pp2"),
    ("debug", "dp2-cp2r"),
    ("debug", "dp1-tp2-cp2u"),
    ("debug-moe", "dp2-cp2u-ep2"),
]
FULL_ONLY = [("debug", "dp2-tp2-pp2")]  # 8 ranks on 2 cores: too slow for --quick
SEQ_LEN = 512
GLOBAL_BATCH = 4  # micro-batches per step over all replicas: every dp above divides it and leaves >= pp each
TIMEOUT_S = 300  # process-group timeout: a failing rank fails the others instead of hanging them


def bench_recipe(root: Path, flavor: str, plan: ParallelPlan) -> Recipe:
    return Recipe.model_validate({
        "experiment": {"name": "parallel-bench", "output_dir": str(root / "out"), "seed": 5},
        "data": {"path": str(root / "data"), "synthetic": {"num_samples": 400}, "seq_len": SEQ_LEN},
        "model": {"flavor": flavor},
        "parallel": {
            "dp_replicate": plan.dp_replicate, "dp_shard": plan.dp_shard, "tp": plan.tp, "pp": plan.pp,
            "pp_schedule": plan.pp_schedule, "cp": plan.cp, "cp_kind": plan.cp_kind, "ep": plan.ep,
        },
        "train": {"steps": 1000, "warmup_steps": 1, "grad_accum": GLOBAL_BATCH // plan.dp, "ckpt_every": 0},
    })


def _rank(rank: int, world: int, root: str, out_dir: str, flavor: str, name: str, steps: tuple[int, int]) -> None:
    """One rank: build its share of the model, run warm-up then timed steps, write its timings, exit."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    if world > 1:
        store = dist.FileStore(str(Path(out_dir, "store")), world)
        dist.init_process_group(process_group_backend("auto"), store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=TIMEOUT_S))
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=device)
    plan = ParallelPlan.parse(name)
    recipe = bench_recipe(Path(root), flavor, plan)
    if resolve_plan(recipe, world) != plan:  # also checks the plan against the model and the sequence length
        raise ValueError(f"recipe does not express plan {name}")
    dtype = resolve_dtype(recipe.train.dtype, device)
    replica = build_replica(recipe, plan, info, dtype)
    optimizers = Optimizers(replica.parts, recipe)
    dataset = open_dataset(recipe)
    batches = iter(PackedLoader(dataset, recipe.data, "train", replica.data_rank, plan.dp, recipe.experiment.seed))
    warmup, timed = steps
    step_s, tokens = [], []
    for step in range(warmup + timed):
        start = time.perf_counter()  # as the trainer times a step: fetching its micro-batches included
        micro = [next(batches).to(device) for _ in range(recipe.train.grad_accum)]
        stats = train_step(replica, optimizers, micro, grad_clip=recipe.train.grad_clip, compute_dtype=dtype)
        if cuda:
            torch.cuda.synchronize(device)
        if step >= warmup:
            step_s.append(time.perf_counter() - start)
            tokens.append(stats.tokens)
    report = {"step_s": step_s, "tokens": tokens, "peak_mem_mb": peak_memory_mb(device)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    shutdown(0)  # barrier, leave the group, skip the interpreter teardown that sometimes aborts on gloo


def run_plan(root: Path, flavor: str, name: str, steps: tuple[int, int]) -> dict:
    """Fork the plan's ranks and combine their timings: a step lasts as long as its slowest rank."""
    world = ParallelPlan.parse(name).world_size
    with tempfile.TemporaryDirectory(dir=root) as out_dir:
        started = time.perf_counter()
        mp.start_processes(_rank, args=(world, str(root), out_dir, flavor, name, steps),
                           nprocs=world, start_method="spawn" if torch.cuda.is_available() else "fork")
        launch_s = time.perf_counter() - started
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    step_s = [max(times) for times in zip(*(r["step_s"] for r in ranks))]
    tokens = ranks[0]["tokens"]  # train_step sums tokens over the world: every rank holds the same counts
    return {
        "world": world,
        "flavor": flavor,
        "plan": name,
        "tokens_per_s": sum(tokens) / sum(step_s),
        "step_s": statistics.median(step_s),
        "peak_mem_mb": max(r["peak_mem_mb"] for r in ranks),
        "tokens_per_step": statistics.mean(tokens),
        "wall_s": launch_s,  # launch, build, warm-up and timed steps
    }


def measure(root: Path, plans: list[tuple[str, str]], steps: tuple[int, int], rounds: int) -> dict[str, dict]:
    """Every plan once per round, keeping each plan's fastest round: other work on a shared machine only ever
    slows a plan down, and rounds spread that interference over all plans instead of a few."""
    max_world = torch.cuda.device_count() if torch.cuda.is_available() else None
    results: dict[str, dict] = {}
    for _ in range(rounds):
        for flavor, name in plans:
            key, world = f"{flavor}/{name}", ParallelPlan.parse(name).world_size
            if "error" in results.get(key, {}):
                continue
            if max_world is not None and world > max_world:
                results[key] = {"world": world, "flavor": flavor, "plan": name,
                                "skipped": f"needs {world} GPUs, {max_world} present"}
                continue
            try:
                result = run_plan(root, flavor, name, steps)
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
                results[key] = {"world": world, "flavor": flavor, "plan": name, "error": str(err)}
                print(f"{key}: FAILED\n{err}", file=sys.stderr)
                continue
            print(f"{key:24} world {world}  {result['tokens_per_s']:8.0f} tokens/s  step {result['step_s']:.3f} s  "
                  f"peak {result['peak_mem_mb']:.0f} MB  ({result['wall_s']:.1f} s)", flush=True)
            rounds_seen = results.get(key, {}).get("rounds_tokens_per_s", []) + [result["tokens_per_s"]]
            if result["tokens_per_s"] >= max(rounds_seen):
                results[key] = result
            results[key]["rounds_tokens_per_s"] = rounds_seen
    for result in results.values():
        base = results.get(f"{result['flavor']}/dp1", {}).get("tokens_per_s")
        if "tokens_per_s" in result:
            result["ratio_to_world1"] = result["tokens_per_s"] / base if base else None
    return results


def machine() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else (platform.processor() or "cpu"),
        "gpus": torch.cuda.device_count() if cuda else 0,
        "backend": "nccl" if cuda else "gloo",
        "threads_per_rank": None if cuda else 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, fewer steps, no 8-rank plan (< 2 min on CPU)")
    parser.add_argument("--out", default="parallel_bench.json")
    args = parser.parse_args()
    steps, rounds = ((1, 1), 1) if args.quick else ((2, 4), 2)
    plans = PLANS if args.quick else PLANS + FULL_ONLY
    cuda = torch.cuda.is_available()
    started = time.perf_counter()
    report: dict = {
        "machine": machine(),
        "workload": {
            "flavors": sorted({flavor for flavor, _ in plans}),
            "seq_len": SEQ_LEN,
            "micro_batch": 1,
            "global_batch_micro_batches": GLOBAL_BATCH,
            "global_batch_tokens": GLOBAL_BATCH * SEQ_LEN,
            "micro_batches_per_replica": "global_batch / dp",
            "dtype": "bfloat16 autocast where supported" if cuda else "float32",
            "warmup_steps": steps[0],
            "timed_steps": steps[1],
            "rounds": rounds,
        },
        "notes": (
            "tokens_per_s counts real (non-padding) tokens of all replicas per second of timed steps (micro-batch "
            "loading included, as in the trainer) in the plan's fastest round; a step lasts as long as its "
            "slowest rank. peak_mem_mb is the maximum over ranks: on CPU the process's peak resident set, which "
            "includes the interpreter and torch inherited from the parent (baseline_mb). World 1 is one "
            "single-threaded rank, so a plan of N ranks can at best reach min(N, cpu_count) times its "
            "throughput, less when others share the cores (load_average): on a small CPU the ratios show what "
            "each dimension costs, not how it scales."
        ),
        "load_average": {"start": os.getloadavg()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ensure_dataset(bench_recipe(root, "debug", ParallelPlan()))  # once, before forking: the ranks read it
        preimport()
        report["baseline_mb"] = None if cuda else peak_memory_mb(torch.device("cpu"))
        report["results"] = measure(root, plans, steps, rounds)
    report["load_average"]["end"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2))
    for key, result in report["results"].items():
        if "tokens_per_s" in result:
            ratio = result["ratio_to_world1"] or float("nan")
            print(f"{key:24} {result['tokens_per_s']:8.0f} tokens/s  ratio {ratio:.2f}  peak {result['peak_mem_mb']:.0f} MB")
    if any("error" in r for r in report["results"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
