"""Workload balancing (`data.balance`): MegaScale-Omni's grouped reordering against no balancing and a global
balancer, simulated at cluster scale and measured on this machine's ranks.

    python benchmarks/balance_bench.py [--quick] --out balance.json

`simulated`: the loaders' own placement (`data.balance.simulate`) on samples drawn as recipes/dynamic_mix.yaml
draws them (its public-dataset lengths; 64k-token sequences, STEP_BATCHES micro-batches per rank and step,
costs of the paper-scale flavor SIM_FLAVOR), at the mixes of SIM_STEPS of its schedule (text-heavy, the audio
burst, image-heavy). Per world, group size and policy: the median over those mixes of the per-step imbalance
(max / mean of the ranks' predicted cost) and the metadata bytes a rank reads per step (`simulated_by_mix`
has each mix, with `fill`: the share of sequence tokens used). The largest worlds simulate fewer steps.

`measured`: training on CPU ranks (the layout bench's workload: debug-enc, 1,024-token sequences, GLOBAL_MICRO
micro-batches per step over the data ranks), plan dp<world> with encoder layout LAYOUT, `none` (each rank packs
its own stream by tokens and encodes its own items) against `grouped` (one group of all data ranks: the
loaders place by cost, the encoders balance within the group, the embeddings are resharded to their LLM
ranks); one launch per (world, policy) trains every mix, rounds interleave the launches and each figure is the
median over rounds. `imbalance` is the predicted one of the batches the ranks trained (max / mean over ranks
of the loader's cost model, encoders + LLM, median over steps); `llm_s_ratio` the measured slowest over mean
LLM seconds (collectives make ranks wait for each other, so measured seconds even out); `step_s` and
`samples_per_step` split samples/s into its two factors (every sequence is full, so a step's tokens are the
same under both policies; the samples a step holds are not). `overhead_pct`: the
slowest rank's placement seconds over the step's, median over grouped steps. Run it alone; the report records
the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from omni_core.common.plan import ParallelPlan
from omni_core.data.balance import POLICIES, SampleCost, balance_for, simulate
from omni_core.data.dataset import open_dataset
from omni_core.data.loader import PackedLoader
from omni_core.data.sample import SIZE_FIELDS, measure
from omni_core.data.synthetic import TRAIN
from omni_core.data.workload import MODALITY_FIELD, MixSchedule, draw_modalities, draw_specs, segments_of, uniforms
from omni_core.recipe.loader import load_recipe, override_recipe
from omni_core.recipe.schema import Recipe
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.ranks import preimport, run_ranks
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.plan_rules import shards_per_node
from omni_core.runtime.replica import build_replica
from omni_core.runtime.step import train_step
from omni_core.runtime.trainer import resolve_dtype

sys.path.insert(0, str(Path(__file__).parent))
from layout_bench import FLAVOR, GLOBAL_MICRO, MIXES, SEQ_LEN  # noqa: E402 - the same workload
from layout_bench import bench_recipe as layout_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIM_RECIPE = ROOT / "recipes" / "dynamic_mix.yaml"
SIM_FLAVOR = "vit-1b+llama-12b"
SIM_STEPS = {"text-heavy": 0, "audio-burst": 550, "image-heavy": 2000}
STEP_BATCHES = 8
LAYOUT = "omni"
SEED = 11


def draw(recipe: Recipe, n: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and [n, 2] costs of n samples of the recipe's dynamic stream at a step's mix (vectorized: the
    loaders draw the same sizes one by one)."""
    cfg, syn = recipe.data, recipe.data.synthetic
    index = np.arange(n)
    shares = np.asarray(MixSchedule(syn).at(step))
    modality = draw_modalities(shares, uniforms(recipe.experiment.seed, TRAIN, index, MODALITY_FIELD))
    specs = draw_specs(syn, recipe.experiment.seed, TRAIN, index, modality)
    sizes = measure(segments_of(specs, cfg.sample_rate), n, cfg)
    usable = np.array([not p for p in sizes.problem])
    columns = SimpleNamespace(**{name: getattr(sizes, name)[usable] for name in SIZE_FIELDS})
    cost = SampleCost.for_flavor(SIM_FLAVOR, patch_size=cfg.patch_size, n_mels=cfg.n_mels)
    return columns.tokens, cost.of(columns)


def simulated(worlds: list[int], groups: list[int], steps: int) -> tuple[dict, dict]:
    recipe = load_recipe(SIM_RECIPE)
    cfg = recipe.data
    by_mix: dict = {}
    for mix, at in SIM_STEPS.items():
        per_sample = draw(recipe, 20_000, at)[0].mean()
        for world in worlds:
            steps_here = max(1, min(steps, steps * 512 // world))  # the largest worlds: fewer steps
            need = int(world * STEP_BATCHES * cfg.seq_len / per_sample * (steps_here + cfg.pack_lookahead) * 1.2)
            tokens, costs = draw(recipe, need, at)
            for group in (g for g in groups if g <= world):
                for policy in POLICIES:
                    if policy != "grouped" and group != groups[0]:
                        continue  # none and global do not depend on the group size
                    started = time.perf_counter()
                    figures = simulate(tokens, costs, policy, world, group, STEP_BATCHES, cfg.seq_len,
                                       cfg.pack_lookahead, steps_here)
                    by_mix.setdefault(mix, {}).setdefault(world, {}).setdefault(group, {})[policy] = figures
                    print(f"simulated {mix:11} world {world:5} group {group:3} {policy:8} "
                          f"imbalance {figures['imbalance']:.3f} fill {figures['fill']:.3f} "
                          f"metadata {figures['metadata_bytes_per_rank'] / 1e3:.0f} kB "
                          f"({time.perf_counter() - started:.1f} s)", flush=True)
    out: dict = {}
    for world in worlds:
        for group in (g for g in groups if g <= world):
            for policy in POLICIES:
                source = group if policy == "grouped" else groups[0]
                seen = [by_mix[m][world][source][policy] for m in SIM_STEPS]
                out.setdefault(world, {}).setdefault(group, {})[policy] = {
                    key: statistics.median(s[key] for s in seen) for key in seen[0]}
    return out, by_mix


def bench_recipe(root: Path, mix: dict[str, float], plan: ParallelPlan, policy: str) -> Recipe:
    """The layout bench's recipe under a balancing policy (with a seed of its own)."""
    overrides = ["experiment.name=balance-bench", f"experiment.seed={SEED}", f"data.balance.policy={policy}"]
    return override_recipe(layout_recipe(root, mix, plan), overrides)


def _rank(rank: int, world: int, root: str, policy: str, steps: tuple[int, int]) -> dict:
    """Every mix under one policy on this rank: per timed step its seconds and metrics."""
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=device)
    plan = ParallelPlan.parse(f"dp{world}+{LAYOUT}")
    out = {}
    for mix_name, mix in MIXES.items():
        recipe = bench_recipe(Path(root), mix, plan, policy)
        dtype = resolve_dtype(recipe.train.dtype, device)
        replica = build_replica(recipe, plan, info, dtype)
        optimizers = Optimizers(replica.parts, recipe)
        balance = balance_for(recipe, replica.data_rank, plan.dp, shards_per_node(plan, info.world_size))
        batches = iter(PackedLoader(open_dataset(recipe), recipe.data, "train", replica.data_rank, plan.dp,
                                    recipe.experiment.seed, balance))
        records = []
        for step in range(sum(steps)):
            start = time.perf_counter()
            micro = [next(batches).to(device) for _ in range(recipe.train.grad_accum)]
            stats = train_step(replica, optimizers, micro, grad_clip=recipe.train.grad_clip, compute_dtype=dtype)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= steps[0]:
                records.append({"step_s": time.perf_counter() - start, "samples": stats.samples, **stats.metrics})
        replica.meshes.release()
        out[mix_name] = records
    return out


def launch(root: Path, world: int, policy: str, steps: tuple[int, int]) -> dict:
    ranks = run_ranks(_rank, world, str(root), policy, steps, backend="auto")
    result = {}
    for mix in MIXES:
        per_step = list(zip(*(r[mix] for r in ranks), strict=True))
        step_s = [max(rec["step_s"] for rec in step) for step in per_step]
        first = [step[0] for step in per_step]  # the world-reduced metrics agree on all ranks
        predicted = [(r["imbalance_pred_encoder"], r["imbalance_pred_llm"]) for r in first]
        result[mix] = {
            "samples_per_s": sum(r["samples"] for r in first) / sum(step_s),
            "step_s": statistics.median(step_s),
            "samples_per_step": statistics.median(r["samples"] for r in first),
            "imbalance": statistics.median(r["imbalance_pred_total"] for r in first),
            "imbalance_encoder": statistics.median(p[0] for p in predicted),
            "imbalance_llm": statistics.median(p[1] for p in predicted),
            "llm_s_ratio": statistics.median(r["llm_s_max"] / r["llm_s_mean"] for r in first),
            "encoder_s_ratio": statistics.median(r["encoder_s_max"] / max(r["encoder_s_mean"], 1e-9) for r in first),
            "overhead_pct": statistics.median(100 * r["balance_s"] / s for r, s in zip(first, step_s)),
            "handoff_bytes": statistics.median(r.get("handoff_bytes", 0.0) for r in first),
        }
    return result


def measured(worlds: list[int], rounds: int, steps: tuple[int, int]) -> dict:
    seen: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for world in worlds:
                for policy in ("none", "grouped"):
                    started = time.perf_counter()
                    for mix, figures in launch(Path(tmp), world, policy, steps).items():
                        seen.setdefault(mix, {}).setdefault(world, {}).setdefault(policy, []).append(figures)
                    print(f"measured world {world} {policy:8} ({time.perf_counter() - started:.0f} s)", flush=True)
    out: dict = {}
    for mix, worlds_seen in seen.items():
        for world, policies in worlds_seen.items():
            for policy, runs in policies.items():
                rates = [r["samples_per_s"] for r in runs]
                figures = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                figures["spread_pct"] = 100 * (max(rates) - min(rates)) / statistics.median(rates)
                out.setdefault(mix, {}).setdefault(world, {})[policy] = figures
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer worlds, one round, fewer steps (< 2 min)")
    parser.add_argument("--out", default="balance.json")
    args = parser.parse_args()
    if args.quick:
        worlds, groups, sim_steps, ranks, rounds, steps = [8, 64], [8, 64], 2, [2], 1, (1, 2)
    else:
        worlds, groups, sim_steps, ranks, rounds, steps = [8, 64, 512, 4096], [8, 16, 64], 3, [2, 4], 3, (3, 4)
    started = time.perf_counter()
    report: dict = {"load_average": {"start": os.getloadavg()},
                    "workload": {"simulated": {"recipe": str(SIM_RECIPE.relative_to(ROOT)), "flavor": SIM_FLAVOR,
                                               "mix_steps": SIM_STEPS, "step_batches": STEP_BATCHES,
                                               "steps": sim_steps},
                                 "measured": {"flavor": FLAVOR, "seq_len": SEQ_LEN, "layout": LAYOUT,
                                              "global_micro_batches": GLOBAL_MICRO, "mixes": MIXES,
                                              "rounds": rounds, "warmup_steps": steps[0], "timed_steps": steps[1],
                                              "device": "cuda" if torch.cuda.is_available() else "cpu"}}}
    report["simulated"], report["simulated_by_mix"] = simulated(worlds, groups, sim_steps)
    preimport()
    report["measured"] = measured(ranks, rounds, steps)
    report["speedup_grouped_vs_none"] = {
        mix: {world: p["grouped"]["samples_per_s"] / p["none"]["samples_per_s"] for world, p in by_world.items()}
        for mix, by_world in report["measured"].items()}
    report["overhead_pct"] = statistics.median(
        p["grouped"]["overhead_pct"] for by_world in report["measured"].values() for p in by_world.values())
    report["load_average"]["end"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2))
    for mix, by_world in report["speedup_grouped_vs_none"].items():
        print(f"{mix:6} " + "  ".join(f"world {w}: grouped/none {r:.2f}x" for w, r in by_world.items()))
    print(f"overhead {report['overhead_pct']:.2f}% of a step; wrote {args.out} in {report['wall_s']:.0f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
