"""Estimator benchmark: accuracy against real runs, speed, and MegaScale-Omni's workloads predicted.

    .venv/bin/python benchmarks/estimator_bench.py [--quick] --out report.json

1. Calibrate the CPU "device": a kernel micro-profile in process CPU time (matmuls, per-document attention,
   operators, the runtime's optimizer, memory), every probe sampled in interleaved passes and averaged, and
   a probe on 2 gloo ranks (collectives, FSDP units, TP modules, pipeline micro-batches, DTensor parameters,
   shared memory bandwidth, straggling).
2. Validate: run the real runtime under plans with DP (FSDP/HSDP), TP, PP (1F1B, interleaved, GPipe), CP
   (Ulysses, ring) and EP, world 1-4, debug / debug-moe / small flavors and several mixes, and compare each
   case's mean wall-clock step with its prediction from step 1 (never fitted to these runs; the kernels are
   profiled right before each run, the ranks probe once per round, the loader's own speed on the case's data
   alone): `mape_pct`, `mape_pct_by_world`, `n_plans_validated`, and per case in `validation`. It runs in
   `validation_rounds` rounds (3; quick 1), means over rounds are compared, and `measured_spread_pct` /
   `predicted_spread_pct` say how far the rounds themselves disagree (this host's drift; null for 1 round).
3. Speed: `plans_per_s` (cost-model evaluations) and `celltable_seconds` (every Cell of the Crius trace's
   model x batch mix on its 1,280-GPU A100/V100/A40/A10 cluster).
4. `paper_workloads[A-D][image:text] = {omni_step_s, coupled_step_s, disaggregated_step_s,
   speedup_vs_best_baseline}` on H100s, 8 per node, 8 x 400 Gb/s per node across nodes; `paper_assumptions`
   says what the layouts assume.
5. `paper_dynamic[A-D][drift|stationary]`: the same workloads over a run whose data moves (recipes/dynamic_mix.yaml:
   its image:text drift, 1:9 to 9:1, or its stationary mix; image sides and text lengths drawn per step), each
   system deployed as it runs (`estimator.dynamic.SYSTEMS`: one plan per job, chosen on the first window or the
   run's average, its own balancing or none), priced step by step and summed: `run_s` per system, `vs_omni`
   (a system's run over omni's), and `fixed_mix_vs_omni` (each layout's best plan for the run's average data,
   balanced perfectly: the question the fixed-mix table answers). `--paper-dynamic` runs only this section
   (arithmetic, no calibration).
--quick keeps every key with 10 validation cases of 5 steps in one round and three mixes of the paper's
table (about two minutes on 2 cores). `load_average` is the host's before and after.

    .venv/bin/python benchmarks/estimator_bench.py --repredict report.json --out repredicted.json

predicts a stored report's validation again with this checkout's cost model, from the report's own
calibrations (seconds): the validation's keys, beside the report's `source_mape_pct`. Rounds of the same
case moved by tens of percent here (`measured_spread_pct`), as much as a model change moves it, so a change
is judged on the same measurements before and after.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from omni_core.common.catalog import GpuCatalog
from omni_core.estimator.cost import Efficiency, Options, estimate_step
from omni_core.estimator.dynamic import SYSTEMS, DynamicRun, drift_shares, stationary_shares
from omni_core.estimator.layouts import compare_layouts
from omni_core.estimator.paper_workloads import PAPER_WORKLOADS, paper_workload
from omni_core.estimator.search import build_cell_table, candidate_plans
from omni_core.estimator.trace_workloads import trace_workload
from omni_core.measure.stored_reports import ReportError, repredicted, validation_keys
from omni_core.measure.validate import calibrate_and_validate
from omni_core.measure.validation_report import validation_figure
from omni_core.recipe.loader import load_recipe

TRACE = ROOT.parent / "shared" / "data" / "traces" / "crius" / "simulate_trace_philly.csv"
CRIUS_GPUS = {"a100": 320, "v100": 320, "a40": 320, "a10": 320}
CRIUS_PER_NODE = {"a100": 4, "v100": 16, "a40": 2, "a10": 2}
PAPER_REPORTED = {"abstract": "1.27x-7.57x over four systems",
                  "best_speedup_unconfirmed": {"A": 1.54, "B": 3.30, "C": 7.57, "D": 1.98}}
SYSTEM_OF_LAYOUT = {system.layout: name for name, system in SYSTEMS.items()}
PAPER_ASSUMPTIONS = (
    "Each layout gets its own best plan (DP x TP x PP x CP, micro-batch, checkpointing) on H100s with the default "
    "GPU efficiencies (60% of peak for matmuls, 45% for attention, 80% of link bandwidth, 80% of DP traffic hidden). "
    "Each layout is a plan's encoder half (ParallelPlan.encoders, in the plan names). omni, as omni_core's runtime "
    "executes it: encoders data-parallel over all GPUs, the step's images balanced over them, the longest split "
    "over an LSSP group with its long-item threshold (searched), weights replicated or FSDP over the world "
    "(searched), the phased schedule (the step's encoder forward, the LLM on detached embeddings, the encoder "
    "backward: no pipeline bubble hides encoder work, so the encoders' activations of the whole step are held), inputs and embeddings moved by all-to-alls. coupled (Megatron-LLaVA): encoders on "
    "pipeline stage 0 with the LLM's DP x TP, the load imbalance of unbalanced batches. disaggregated "
    "(DistTrain-like): encoders on GPUs of their own, as many as the LLM leaves, the LLM a Megatron-LM layout "
    "(pipeline depths dividing its layers, DP dividing the batch; DistTrain's orchestration, "
    "estimator.orchestration), embeddings shipped between them. Images: 1,024 patches (448 px at patch 14), 2x2 "
    "merged to 256 LLM tokens; text documents of 2,048 tokens.")


def plans_per_second(min_seconds: float = 1.0) -> float:
    """Cost-model evaluations per second over every candidate plan of a few workloads on 64 GPUs, repeated
    for at least `min_seconds`."""
    gpu = GpuCatalog()["a100"]
    jobs = [trace_workload("bert__2.6B", 256), trace_workload("moe__10B", 512), paper_workload("C", 0.5)]
    plans = [(w, p) for w in jobs for pp in (1, 2, 4, 8) for p in candidate_plans(w, 64, 8, pp)]
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        for w, p in plans:
            estimate_step(w, gpu, p, Options(1), gpus_per_node=8)
        done += len(plans)
    return done / (time.perf_counter() - start)


def crius_cell_table() -> tuple[float, int, int]:
    rows = list(csv.DictReader(TRACE.open()))
    mix = sorted({(r["model_name"], int(r["batch_size"])) for r in rows})
    jobs = {f"{m}@{b}": trace_workload(m, b) for m, b in mix}
    start = time.perf_counter()
    table = build_cell_table(jobs, GpuCatalog(), CRIUS_GPUS, gpus_per_node=CRIUS_PER_NODE, workers=os.cpu_count() or 1)
    return time.perf_counter() - start, len(jobs), len(table.cells)


def paper(quick: bool) -> dict:
    h100 = GpuCatalog()["h100"]
    shares = (0.1, 0.5, 0.9) if quick else tuple(i / 10 for i in range(1, 10))
    out: dict = {}
    for key, (_, gpus, _, _) in PAPER_WORKLOADS.items():
        out[key] = {}
        for share in shares:
            res = compare_layouts(paper_workload(key, share), h100, gpus, 8, Efficiency())
            omni = res["omni"].step_time_s
            baselines = [r.step_time_s for name, r in res.items() if name != "omni" and r.step_time_s]
            out[key][f"{round(share * 10)}:{round((1 - share) * 10)}"] = {
                "omni_step_s": omni, "coupled_step_s": res["coupled"].step_time_s,
                "disaggregated_step_s": res["disaggregated"].step_time_s,
                "speedup_vs_best_baseline": (min(baselines) / omni) if omni and baselines else None,
                "plans": {name: r.plan for name, r in res.items()},
            }
    return out


DYNAMIC_RECIPE = ROOT / "recipes" / "dynamic_mix.yaml"
DYNAMIC_STEPS = 50  # --quick: the run's trajectory over this many steps (the full run: the recipe's train.steps)


def paper_dynamic(quick: bool) -> dict:
    """`paper_dynamic`: workloads A-D along dynamic_mix.yaml's drift and at its stationary mix, every system
    deployed once and priced step by step, beside each layout's best plan for the run's average data."""
    recipe = load_recipe(DYNAMIC_RECIPE)
    h100, eff, syn = GpuCatalog()["h100"], Efficiency(), recipe.data.synthetic
    steps = DYNAMIC_STEPS if quick else recipe.train.steps
    trajectories = {"drift": drift_shares(syn, steps, max(p.step for p in syn.schedule)),
                    "stationary": stationary_shares(syn, steps)}
    out: dict = {"steps": steps, "recipe": str(DYNAMIC_RECIPE.relative_to(ROOT)),
                 "rules": {name: asdict(system) for name, system in SYSTEMS.items()}}
    for key in PAPER_WORKLOADS:
        out[key] = {}
        for name, shares in trajectories.items():
            run = DynamicRun(key, recipe.data, shares, h100, eff, seed=recipe.experiment.seed)
            systems = run.price()
            assert run.average is not None
            fixed = compare_layouts(run.average, h100, PAPER_WORKLOADS[key][1], 8, eff)
            omni, omni_fixed = systems["omni"].run_s, fixed["omni"].step_time_s
            out[key][name] = {
                "image_share": {"first": float(shares[0]), "last": float(shares[-1]), "mean": float(shares.mean())},
                "systems": {system: asdict(price) for system, price in systems.items()},
                "vs_omni": {system: p.run_s / omni if p.run_s and omni else None for system, p in systems.items()},
                "fixed_mix_vs_omni": {SYSTEM_OF_LAYOUT[layout]: r.step_time_s / omni_fixed
                                      if r.step_time_s and omni_fixed else None for layout, r in fixed.items()},
                "fixed_mix_plans": {SYSTEM_OF_LAYOUT[layout]: r.plan for layout, r in fixed.items()},
            }
            print(key, name, {s: round(v, 2) if v else None for s, v in out[key][name]["vs_omni"].items()},
                  "fixed mix", {s: round(v, 2) if v else None for s, v in out[key][name]["fixed_mix_vs_omni"].items()},
                  flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="estimator_report.json")
    parser.add_argument("--repredict", type=Path, metavar="REPORT",
                        help="only predict REPORT's validation again, from its own calibrations (seconds)")
    parser.add_argument("--paper-dynamic", action="store_true",
                        help="only the paper_dynamic section (arithmetic: no calibration, no validation)")
    args = parser.parse_args()
    if args.paper_dynamic:
        started, load = time.perf_counter(), os.getloadavg()
        result = {"paper_dynamic": paper_dynamic(args.quick), "paper_reported": PAPER_REPORTED, "quick": args.quick,
                  "load_average": [load, os.getloadavg()], "seconds": time.perf_counter() - started}
        Path(args.out).write_text(json.dumps(result, indent=2))
        return
    if args.repredict:
        started, load = time.perf_counter(), os.getloadavg()
        try:
            result = repredicted(args.repredict)
        except ReportError as exc:
            raise SystemExit(str(exc)) from exc
        result.update(load_average=[load, os.getloadavg()], seconds=time.perf_counter() - started)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps({k: v for k, v in result.items() if k not in ("validation", "calibration")}, indent=2))
        return
    started, load = time.perf_counter(), os.getloadavg()

    plans_s = plans_per_second()
    cell_s, n_jobs, n_cells = crius_cell_table()
    workloads = paper(args.quick)
    dynamic = paper_dynamic(args.quick)
    with tempfile.TemporaryDirectory(prefix="omni-validate-") as tmp:
        report = calibrate_and_validate(args.quick, Path(tmp))
    result = {
        **validation_keys(report),
        "plans_per_s": plans_s,
        "celltable_seconds": cell_s,
        "celltable_jobs": n_jobs,
        "celltable_cells": n_cells,
        "paper_workloads": workloads,
        "paper_dynamic": dynamic,
        "paper_reported": PAPER_REPORTED,
        "paper_assumptions": PAPER_ASSUMPTIONS,
        "validation": [r.model_dump() for r in report.rows],
        "calibration": report.calibration,
        "quick": args.quick,
        "load_average": [load, os.getloadavg()],
        "seconds": time.perf_counter() - started,
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    validation_figure(report, Path(args.out).with_suffix(".png"))  # predicted vs measured, beside the report
    print(json.dumps({k: v for k, v in result.items() if k not in ("validation", "paper_workloads")}, indent=2))
    for key, mixes in result["paper_workloads"].items():
        print(key, {m: (round(v["speedup_vs_best_baseline"], 2) if v["speedup_vs_best_baseline"] else None)
                    for m, v in mixes.items()})


if __name__ == "__main__":
    main()
