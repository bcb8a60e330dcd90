"""Encoder layouts side by side: `omni` (MegaScale-Omni: encoders over every rank, balanced, LSSP for long
items; the phased schedule), `omni_joint` (the same under the joint encoder-LLM schedule: encoders per
micro-batch in the ranks' idle time), `coupled` (Megatron-LLaVA: encoders on the first stage, replicated over
TP) and `disaggregated` (DistTrain: encoders on ranks of their own, pipelined with the LLM per micro-batch, the
joint schedule), on the same data, per image:text mix and plan, with the estimator's predicted speedups over
coupled next to the measured ones (this machine's stored calibration:
`python -m omni_core.measure.calibrate cpu` first, else the catalogue's cpu entry; the report says which).
Full runs add `omni_lssp`: omni with the images over LSSP_TOKENS patches split over 2 ranks.

    python benchmarks/layout_bench.py [--quick] --out layout.json

Model `debug-enc` (debug's LLM with encoders as wide and as deep), packed micro-batches of
SEQ_LEN tokens drawn on the fly (data.source=dynamic) with images of IMAGE_SIDE_PX, the same global batch of
GLOBAL_MICRO micro-batches for every plan, balanced over the data ranks by the default `data.balance` (grouped:
benchmarks/balance_bench.py compares the policies). One launch per (plan, layout) trains every mix in turn, `steps`
warm-up then timed steps each; rounds interleave the launches, and each figure is the median over rounds
(`spread_pct` = (max - min) / median of samples/s). A step lasts as long as its slowest rank. `encoder_s` /
`llm_s` are the median over timed steps of the busiest rank's encoder compute (forward and backward; coupled:
0, its encoders run inside the LLM's stage 0) and of its LLM phase. `bubble_pct` is the idle share of a rank's
span of encoder and LLM work (`runtime.layout_metrics.layout_values`), mean over the LLM's ranks: for pipelined plans
the bubble the joint schedule fills. On CPU `peak_mem_mb` is the peak resident set of
the launch (all its mixes so far).

Run it alone (it forks one rank per core at world 2); the report records the load average. On a GPU machine
it runs the same cases with nccl, one GPU per rank.
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

import torch

from omni_core.common.plan import EncoderPlan, ParallelPlan
from omni_core.data.balance import balance_for
from omni_core.data.dataset import open_dataset
from omni_core.data.loader import PackedLoader
from omni_core.data.profile import profile_dataset
from omni_core.estimator.calibration import calibration_digest
from omni_core.estimator.recipe_cells import predicted_step_times
from omni_core.recipe.schema import Recipe
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.perf import peak_memory_mb
from omni_core.runtime.ranks import preimport, run_ranks
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.plan_rules import resolve_plan, shards_per_node
from omni_core.runtime.replica import build_replica
from omni_core.runtime.step import train_step
from omni_core.runtime.trainer import resolve_dtype

FLAVOR = "debug-enc"
SEQ_LEN = 1024
QUICK_SEQ_LEN = 512
GLOBAL_MICRO = 4  # micro-batches per step over all data shards
IMAGE_SIDE_PX = (64, 160)  # 8..20 patches a side at patch 8: 64..400 patches, one LLM token each
MIXES = {
    "1:9": {"text": 0.9, "image": 0.1},
    "1:1": {"text": 0.5, "image": 0.5},
    "9:1": {"text": 0.1, "image": 0.9},
    "audio": {"text": 0.3, "audio": 0.7},
}
PLANS = {2: ["dp2", "dp1-tp2", "dp1-pp2"], 4: ["dp4", "dp2-tp2", "dp2-pp2"]}
LAYOUTS = ("coupled", "omni", "omni_joint", "disaggregated")
LSSP_LAYOUT = "omni_lssp"  # full runs only: omni with images over LSSP_TOKENS patches split over 2 ranks
LSSP_TOKENS = 256


def layout_plan(llm: str, layout: str, world: int) -> ParallelPlan:
    """The plan of `layout` for an LLM plan of `world` ranks. Disaggregated keeps the world: the encoders get
    a quarter of it (at least one rank) and the LLM the same degrees on the rest, its data parallelism shrunk."""
    plan = ParallelPlan.parse(llm)
    if layout == "coupled":
        return plan
    if layout in ("omni", "omni_joint"):
        return ParallelPlan.parse(f"{llm}+omni{'-joint' if layout == 'omni_joint' else ''}")
    if layout == LSSP_LAYOUT:
        return ParallelPlan.parse(f"{llm}+omni.v-sp2-t{LSSP_TOKENS}")
    ranks = max(1, world // 4)
    llm_ranks = world - ranks
    others = plan.tp * plan.pp * plan.cp
    dp = max(1, llm_ranks // others)
    if dp * others != llm_ranks:  # e.g. world 2: one LLM rank
        plan = ParallelPlan()
    else:
        plan = ParallelPlan.parse(llm.replace(f"dp{plan.dp}", f"dp{dp}", 1))
    return ParallelPlan(**{**plan.__dict__, "encoders": EncoderPlan("disaggregated", ranks=ranks, schedule="joint")})


def bench_recipe(root: Path, mix: dict[str, float], plan: ParallelPlan) -> Recipe:
    return Recipe.model_validate({
        "experiment": {"name": "layout-bench", "output_dir": str(root / "out"), "seed": 7},
        "data": {"source": "dynamic", "seq_len": SEQ_LEN, "max_image_patches": 400,
                 "synthetic": {"num_samples": 200, "mix": mix,
                               "image_side_px": {"min": IMAGE_SIDE_PX[0], "max": IMAGE_SIDE_PX[1]}}},
        "model": {"flavor": FLAVOR},
        "parallel": plan.recipe_fields(),
        "train": {"steps": 1000, "warmup_steps": 1, "grad_accum": GLOBAL_MICRO // plan.dp, "ckpt_every": 0,
                  "dtype": "auto"},
    })


def _rank(rank: int, world: int, root: str, name: str, steps: tuple[int, int]) -> dict:
    """Every mix under one plan on this rank: per timed step its seconds and metrics."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=device)
    plan = ParallelPlan.parse(name)
    out = {}
    for mix_name, mix in MIXES.items():
        recipe = bench_recipe(Path(root), mix, plan)
        if resolve_plan(recipe, world) != plan:
            raise ValueError(f"the bench recipe does not express plan {name}")
        dtype = resolve_dtype(recipe.train.dtype, device)
        replica = build_replica(recipe, plan, info, dtype)
        optimizers = Optimizers(replica.parts, recipe)
        balance = balance_for(recipe, replica.data_rank, plan.dp, shards_per_node(plan, info.world_size))
        batches = iter(PackedLoader(open_dataset(recipe), recipe.data, "train", replica.data_rank, plan.dp,
                                    recipe.experiment.seed, balance)) if replica.loads_data else None
        records = []
        for step in range(sum(steps)):
            start = time.perf_counter()
            micro = [next(batches).to(device) for _ in range(recipe.train.grad_accum)] if batches else []
            stats = train_step(replica, optimizers, micro, grad_clip=recipe.train.grad_clip, compute_dtype=dtype)
            if cuda:
                torch.cuda.synchronize(device)
            if step >= steps[0]:
                records.append({"step_s": time.perf_counter() - start, "tokens": stats.tokens,
                                "samples": stats.samples, **stats.metrics})
        if replica.meshes is not None:
            replica.meshes.release()
        out[mix_name] = {"records": records, "peak_mem_mb": peak_memory_mb(device)}
    return out


def launch(root: Path, name: str, steps: tuple[int, int]) -> dict:
    """One launch of `name` (all mixes): per mix the step-level figures over its ranks."""
    world = ParallelPlan.parse(name).world_size
    ranks = run_ranks(_rank, world, str(root), name, steps, backend="auto")
    result = {}
    for mix in MIXES:
        per_step = list(zip(*(r[mix]["records"] for r in ranks), strict=True))
        step_s = [max(rec["step_s"] for rec in step) for step in per_step]
        first = [step[0] for step in per_step]  # tokens, samples and the world-reduced metrics agree on all ranks
        result[mix] = {
            "samples_per_s": sum(r["samples"] for r in first) / sum(step_s),
            "tokens_per_s": sum(r["tokens"] for r in first) / sum(step_s),
            "peak_mem_mb": max(r[mix]["peak_mem_mb"] for r in ranks),
            "encoder_s": statistics.median(r["encoder_s_max"] for r in first),
            "llm_s": statistics.median(r["llm_s_max"] for r in first),
            "bubble_pct": statistics.median(r.get("bubble_pct", 0.0) for r in first),
            "step_s": statistics.median(step_s),
        }
    return result


def predicted(root: Path, world: int) -> dict[str, dict[str, dict[str, float | None]]]:
    """The estimator's speedup over coupled per mix, plan and layout (each plan at its own recipe's gradient
    accumulation: the same global batch), from this machine's calibration if one is stored."""
    out: dict = {}
    for mix_name, mix in MIXES.items():
        profile, _ = profile_dataset(bench_recipe(root, mix, ParallelPlan()), root / "profile" / mix_name)
        for llm in PLANS[world]:
            times = {}
            for layout in LAYOUTS:
                plan = layout_plan(llm, layout, world)
                try:
                    times[layout] = predicted_step_times(bench_recipe(root, mix, plan), [plan], profile)[plan.name]
                except ValueError as err:
                    print(f"prediction {mix_name} {plan.name}: {err}", file=sys.stderr)
            out.setdefault(mix_name, {})[llm] = {
                layout: times["coupled"] / t if "coupled" in times else None
                for layout, t in times.items() if layout != "coupled"}
    return out


def measure(root: Path, rounds: dict[int, int], layouts: tuple[str, ...], steps: tuple[int, int]
            ) -> tuple[dict, dict]:
    """`rounds[world]` interleaved rounds of every (plan, layout) launch of that world."""
    rounds_seen: dict[tuple[str, str, str], list[dict]] = {}
    errors: dict[tuple[str, str], str] = {}
    for round_index in range(max(rounds.values())):
        for world in (w for w, n in rounds.items() if round_index < n):
            for llm in PLANS[world]:
                for layout in layouts:
                    name = layout_plan(llm, layout, world).name
                    if (llm, layout) in errors:
                        continue
                    started = time.perf_counter()
                    try:
                        result = launch(root, name, steps)
                    except Exception as err:  # noqa: BLE001 - a layout the runtime refuses is reported, not fatal
                        errors[llm, layout] = f"{name}: {str(err).strip().splitlines()[-1]}"
                        print(f"{llm:8} {layout:14} FAILED {errors[llm, layout]}", file=sys.stderr)
                        continue
                    for mix, figures in result.items():
                        rounds_seen.setdefault((mix, llm, layout), []).append({**figures, "plan": name})
                    print(f"{llm:8} {layout:14} {name:32} " + "  ".join(
                        f"{mix} {f['samples_per_s']:6.2f}/s" for mix, f in result.items()) +
                        f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    results: dict = {}
    for (mix, llm, layout), seen in rounds_seen.items():
        rates = [s["samples_per_s"] for s in seen]
        median = {key: statistics.median(s[key] for s in seen) for key in seen[0] if key != "plan"}
        median.update(plan=seen[0]["plan"], rounds=len(seen),
                      spread_pct=100 * (max(rates) - min(rates)) / statistics.median(rates))
        results.setdefault(mix, {}).setdefault(llm, {})[layout] = median
    for (llm, layout), error in errors.items():
        for mix in MIXES:
            results.setdefault(mix, {}).setdefault(llm, {})[layout] = {"error": error}
    return results, {f"{llm}/{layout}": e for (llm, layout), e in errors.items()}


def speedups(results: dict, layout: str) -> dict:
    out: dict = {}
    for mix, plans in results.items():
        for llm, layouts in plans.items():
            base, other = layouts.get("coupled", {}), layouts.get(layout, {})
            ok = "samples_per_s" in base and "samples_per_s" in other
            out.setdefault(mix, {})[llm] = other["samples_per_s"] / base["samples_per_s"] if ok else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="world 2, one round, fewer steps, QUICK_SEQ_LEN-token "
                        "micro-batches, half as many per step (< 2 min on CPU)")
    parser.add_argument("--out", default="layout.json")
    args = parser.parse_args()
    # the targets are at world 2 (one rank per core): its rounds are the medians; world 4 is one round
    rounds, steps = ({2: 1}, (1, 1)) if args.quick else ({2: 3, 4: 1}, (1, 3))
    if args.quick:  # half the tokens per micro-batch, half the micro-batches: every case within two minutes
        global SEQ_LEN, GLOBAL_MICRO
        SEQ_LEN, GLOBAL_MICRO = QUICK_SEQ_LEN, GLOBAL_MICRO // 2
    layouts = LAYOUTS if args.quick else (*LAYOUTS, LSSP_LAYOUT)
    started = time.perf_counter()
    report: dict = {"load_average": {"start": os.getloadavg()},
                    "workload": {"flavor": FLAVOR, "seq_len": SEQ_LEN, "global_micro_batches": GLOBAL_MICRO,
                                 "image_side_px": IMAGE_SIDE_PX, "mixes": MIXES, "lssp_tokens": LSSP_TOKENS,
                                 "layouts": layouts, "calibration": calibration_digest("cpu") or "catalogue",
                                 "warmup_steps": steps[0], "timed_steps": steps[1],
                                 "rounds_by_world": rounds, "device": "cuda" if torch.cuda.is_available() else "cpu"}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        preimport()
        predictions: dict = {}
        for world in rounds:
            for mix, plans in predicted(root, world).items():
                predictions.setdefault(mix, {}).update(plans)
        report["results"], report["errors"] = measure(root, rounds, layouts, steps)
    report["speedup_vs_coupled"] = speedups(report["results"], "omni")
    report["joint_vs_coupled"] = speedups(report["results"], "omni_joint")
    report["disaggregated_vs_coupled"] = speedups(report["results"], "disaggregated")
    report["predicted_speedup_vs_coupled"] = {mix: {llm: p.get("omni") for llm, p in plans.items()}
                                              for mix, plans in predictions.items()}
    report["predicted_joint_vs_coupled"] = {mix: {llm: p.get("omni_joint") for llm, p in plans.items()}
                                            for mix, plans in predictions.items()}
    report["predicted_disaggregated_vs_coupled"] = {mix: {llm: p.get("disaggregated") for llm, p in plans.items()}
                                                    for mix, plans in predictions.items()}
    report["prediction_error_pct"] = {
        mix: {llm: (100 * (pred / report["speedup_vs_coupled"][mix][llm] - 1)
                    if pred and report["speedup_vs_coupled"][mix].get(llm) else None)
              for llm, pred in plans.items()}
        for mix, plans in report["predicted_speedup_vs_coupled"].items()}
    report["load_average"]["end"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2))
    nan = float("nan")
    for mix, plans in report["speedup_vs_coupled"].items():
        for llm, ratio in plans.items():
            pred = report["predicted_speedup_vs_coupled"][mix].get(llm)
            disagg = report["disaggregated_vs_coupled"][mix].get(llm)
            joint, joint_pred = report["joint_vs_coupled"][mix].get(llm), report["predicted_joint_vs_coupled"][mix].get(llm)
            print(f"{mix:6} {llm:8} omni/coupled measured {ratio or nan:.2f} predicted {pred or nan:.2f}   "
                  f"joint/coupled measured {joint or nan:.2f} predicted {joint_pred or nan:.2f}   "
                  f"disaggregated/coupled measured {disagg or nan:.2f} "
                  f"predicted {report['predicted_disaggregated_vs_coupled'][mix].get(llm) or nan:.2f}")


if __name__ == "__main__":
    main()
