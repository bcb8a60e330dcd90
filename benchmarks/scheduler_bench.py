"""Scheduler benchmark: the Crius, ITP (cluster08) and Philly studies, every policy side by side.

    .venv/bin/python benchmarks/scheduler_bench.py [--quick] --out report.json

Writes traces[name][policy] = {jobs_finished, mean_throughput, mean_jct_s, p99_jct_s, makespan_s,
p95_decision_s, wall_s} plus each trace's job, unmodelled-job and malformed-row counts, and prints the
tables. The recipes (recipes/*_study.yaml) fix cluster, rounds and trace mapping; --quick runs the same
studies over QUICK_ROUNDS rounds. Throughputs come from the estimator's CellOracle. Run from the repo root.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from omni_core.recipe import load_recipe
from omni_core.scheduler.report import format_table, summary
from omni_core.scheduler.study import compare, prepare

STUDIES = {"crius": "recipes/crius_study.yaml", "itp": "recipes/itp_study.yaml", "philly": "recipes/philly_study.yaml"}
POLICIES = ("crius", "fcfs", "gavel", "sia")
QUICK_ROUNDS = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds instead of each recipe's max_rounds")
    parser.add_argument("--out", required=True, metavar="PATH", help="report JSON")
    args = parser.parse_args()
    report: dict = {"rounds": QUICK_ROUNDS if args.quick else "recipe", "traces": {}, "studies": {}}
    for name, path in STUDIES.items():
        tic = time.perf_counter()
        study = prepare(load_recipe(path))
        prep_s = time.perf_counter() - tic
        plans = compare(study, POLICIES, QUICK_ROUNDS if args.quick else None)
        report["traces"][name] = {p: summary(plan.metrics) for p, plan in plans.items()}
        m = next(iter(plans.values())).metrics
        report["studies"][name] = {"recipe": path, "trace": study.source, "jobs": m.jobs, "arrived": m.arrived, "unmodelled": m.unmodelled,
                                   "malformed_rows": m.trace_issues, "rounds": m.rounds, "prepare_s": prep_s}
        print(format_table(plans), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
