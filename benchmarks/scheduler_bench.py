"""Scheduler benchmark: the Crius, ITP (cluster08) and Philly studies, every policy side by side, plus a
contention study and a scale study.

    .venv/bin/python benchmarks/scheduler_bench.py [--quick] --out report.json

Writes, per trace and policy, traces[name][policy] = {jobs_finished, mean_throughput, busy_throughput,
mean_jct_s, mean_jct_h, p99_jct_s, makespan_s, mean_queueing_s, mean_queueing_h, p95_decision_s,
max_decision_s, wall_s, cpu_s}, each trace's job, unmodelled-job and malformed-row counts (studies), and:
  contention  the Crius study with arrivals compressed CONTENTION times (schedule.arrival_compression), every policy;
  scale       the Crius study's cluster and jobs x1, x2, x4 (`study.scaled`) under crius, saturated (SCALE_SETTINGS):
              CPU seconds of the run, p95 and max decision CPU seconds, decisions, GPUs and jobs;
  targets     the issue's targets, each with the measured figure and whether it is met;
  load        os.getloadavg() before and after (the machine may be shared: decision times are CPU seconds).
The recipes (recipes/*_study.yaml) fix cluster, rounds, trace mapping and conventions; --quick runs the same
studies over QUICK_ROUNDS rounds and writes the same keys. Throughputs come from the estimator's CellOracle.
Runs from any directory (the recipes resolve their traces against their own folder).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from omni_core.scheduler.cluster import Cluster
from omni_core.scheduler.report import format_table, summary
from omni_core.scheduler.study import compare, default_oracle, load_study, scaled

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
STUDIES = {"crius": RECIPES / "crius_study.yaml", "itp": RECIPES / "itp_study.yaml",
           "philly": RECIPES / "philly_study.yaml"}
POLICIES = ("crius", "fcfs", "gavel", "sia")
QUICK_ROUNDS = 300
CONTENTION = 10
SCALES = (1, 2, 4)
SCALE_POLICY = "crius"
# The scale study replays the trace's own iterations over 2,000 rounds: saturated, so the queue and each
# decision are as large as the trace makes them (under the artifact's division by 5 the queue stays short).
SCALE_SETTINGS = ["schedule.iteration_scale=1", "schedule.max_rounds=2000"]


def shared_oracle():
    """One estimator oracle for every study (they share the Crius study's cluster shape), so each (model,
    batch, config) is estimated once per benchmark, not once per study."""
    return default_oracle(Cluster.from_config(load_study(STUDIES["crius"]).recipe.cluster))


def run_traces(rounds: int | None, report: dict, oracle) -> None:
    for name, path in STUDIES.items():
        tic = time.process_time()
        study = load_study(path, oracle=oracle)
        prep_s = time.process_time() - tic
        plans = compare(study, POLICIES, rounds)
        report["traces"][name] = {p: summary(plan.metrics) for p, plan in plans.items()}
        m = next(iter(plans.values())).metrics
        report["studies"][name] = {"recipe": str(path), "trace": study.source, "jobs": m.jobs, "arrived": m.arrived,
                                   "unmodelled": m.unmodelled, "malformed_rows": m.trace_issues, "rounds": m.rounds,
                                   "prepare_cpu_s": prep_s}
        print(format_table(plans), flush=True)


def run_contention(rounds: int | None, report: dict, oracle) -> None:
    study = load_study(STUDIES["crius"], [f"schedule.arrival_compression={CONTENTION}"], oracle=oracle)
    plans = compare(study, POLICIES, rounds)
    report["contention"] = {"trace": "crius", "arrival_compression": CONTENTION,
                            "policies": {p: summary(plan.metrics) for p, plan in plans.items()}}
    print(f"contention: arrivals compressed {CONTENTION}x")
    print(format_table(plans), flush=True)


def run_scale(rounds: int | None, report: dict, oracle) -> None:
    base = load_study(STUDIES["crius"], SCALE_SETTINGS, oracle=oracle)
    runs = []
    for factor in SCALES:
        study = scaled(base, factor)
        m = study.run(SCALE_POLICY, rounds).metrics
        runs.append({"factor": factor, "gpus": sum(g.nodes * g.gpus_per_node for g in study.recipe.cluster.node_groups),
                     "jobs": m.jobs, "decisions": m.decisions, "cpu_s": m.cpu_s, "p95_decision_s": m.p95_decision_s,
                     "max_decision_s": m.max_decision_s, "jobs_finished": m.jobs_finished,
                     "busy_throughput": m.busy_throughput})
        print(f"scale x{factor}: {runs[-1]}", flush=True)
    report["scale"] = {"policy": SCALE_POLICY, "settings": SCALE_SETTINGS, "runs": runs}


def targets(report: dict) -> dict:
    """The issue's targets against what was measured (ratios of busy-round throughput, JCT and decisions)."""
    crius = report["traces"]["crius"]
    busy = {p: crius[p]["busy_throughput"] for p in POLICIES}
    jct = {"crius_trace": {p: crius[p]["mean_jct_s"] for p in POLICIES},
           "contention": {p: report["contention"]["policies"][p]["mean_jct_s"] for p in POLICIES}}
    largest = report["scale"]["runs"][-1]
    out = {f"busy_throughput_crius_over_{p}": busy["crius"] / busy[p] if busy[p] else None for p in ("sia", "gavel")}
    out = {k: {"measured": v, "target": 1.3, "met": v is not None and v >= 1.3} for k, v in out.items()}
    for label, by_policy in jct.items():
        best = min(v for p, v in by_policy.items() if p != "crius" and v is not None)
        out[f"mean_jct_{label}_crius_le_every_baseline"] = {
            "measured_h": by_policy["crius"] / 3600, "best_baseline_h": best / 3600, "met": by_policy["crius"] <= best}
    out[f"scale_x{largest['factor']}_p95_decision_s"] = {"measured": largest["p95_decision_s"], "target": 0.2,
                                                          "met": largest["p95_decision_s"] <= 0.2}
    out[f"scale_x{largest['factor']}_max_decision_s"] = {"measured": largest["max_decision_s"], "target": 1.0,
                                                          "met": largest["max_decision_s"] <= 1.0}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds instead of each recipe's max_rounds")
    parser.add_argument("--out", required=True, metavar="PATH", help="report JSON")
    args = parser.parse_args()
    rounds = QUICK_ROUNDS if args.quick else None
    report: dict = {"rounds": rounds or "recipe", "load": {"before": os.getloadavg()}, "traces": {}, "studies": {}}
    tic = time.perf_counter(), time.process_time()
    oracle = shared_oracle()
    run_traces(rounds, report, oracle)
    run_contention(rounds, report, oracle)
    run_scale(rounds, report, oracle)
    report["targets"] = targets(report)
    report["load"]["after"] = os.getloadavg()
    report["wall_s"], report["cpu_s"] = time.perf_counter() - tic[0], time.process_time() - tic[1]
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report["targets"], indent=2))
    print(f"wrote {args.out} (wall {report['wall_s']:.0f} s, CPU {report['cpu_s']:.0f} s, load {report['load']})")


if __name__ == "__main__":
    main()
