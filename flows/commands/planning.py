"""The commands that plan without training: `estimate` (the estimator's best plan on every Cell of the
recipe's cluster) and `simulate` (scheduling policies replayed on a job trace). Both call the library from
this process; no Prefect flow runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from flows.commands.common import OVERRIDES_EPILOG, RAW, USAGE_ERROR, add_recipe_args, loaded_recipe
from omni_core.recipe.schedule_sections import PolicyName

if TYPE_CHECKING:
    from flows.commands.common import Subparsers


def add_estimate(sub: Subparsers) -> None:
    estimate = sub.add_parser(
        "estimate",
        formatter_class=RAW,
        help="predict step time and memory of the recipe's jobs on every Cell of its cluster",
        description="Enumerate Cells (GPU type x GPU count x nodes x pipeline stages) for the recipe's jobs "
        "(`jobs:`, or its own model), search the best plan in each and print them ranked by throughput. "
        "The cluster is `cluster.node_groups`, else `estimate.gpu_types` up to `estimate.max_gpus`. "
        "No MLflow run (`omni run` logs the stage).",
        epilog=OVERRIDES_EPILOG,
    )
    add_recipe_args(estimate)
    estimate.add_argument("--profile", metavar="PATH", help="a DatasetProfile JSON (document lengths, encoder tokens)")
    estimate.add_argument("--out", metavar="PATH", help="write the CellTable JSON to PATH")
    estimate.add_argument("--json", action="store_true", help="print the CellTable as JSON instead of a table")
    estimate.set_defaults(handler=_estimate_command)


def add_simulate(sub: Subparsers) -> None:
    simulate = sub.add_parser(
        "simulate",
        formatter_class=RAW,
        help="replay a job trace on the recipe's cluster under scheduling policies, side by side",
        description="Simulate the recipe's cluster in rounds of schedule.round_s seconds with the estimator as "
        "the throughput oracle: the recipe's jobs, or a trace (Crius, ITP or Philly CSV; raw traces are mapped "
        "to model jobs with schedule.trace_seed). Prints jobs finished, mean throughput, JCT, decision latency "
        "per policy; writes SchedulePlan JSONs and figures to --out and logs them to MLflow (run `simulate`).",
        epilog=OVERRIDES_EPILOG,
    )
    add_recipe_args(simulate)
    simulate.add_argument("--trace", metavar="PATH", help="trace CSV instead of schedule.trace")
    simulate.add_argument(
        "--policy",
        dest="policies",
        action="append",
        metavar="NAME",
        choices=get_args(PolicyName),
        help="policy to run (repeatable); default: schedule.policies, else schedule.policy",
    )
    simulate.add_argument("--rounds", type=int, metavar="N", help="rounds to simulate (default schedule.max_rounds)")
    simulate.add_argument(
        "--out", metavar="DIR", help="directory for the JSONs and figures (default <output_dir>/<experiment>/simulate)"
    )
    simulate.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    simulate.add_argument("--json", action="store_true", help="print per-policy metrics as JSON instead of a table")
    simulate.set_defaults(handler=_simulate_command)


def _estimate_command(args: argparse.Namespace) -> int:
    from omni_core.estimator.recipe_cells import estimate_recipe, format_table

    profile = None
    if args.profile:
        from omni_core.data.profile import DatasetProfile

        profile = DatasetProfile.load(args.profile)
    try:
        table = estimate_recipe(loaded_recipe(args), profile)
    except (KeyError, ValueError) as e:
        print(f"omni: estimate: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return USAGE_ERROR
    if args.out:
        Path(args.out).write_text(table.to_json())
    print(table.to_json() if args.json else format_table(table))
    return 0


def _simulate_command(args: argparse.Namespace) -> int:
    from omni_core.scheduler import report
    from omni_core.scheduler.study import compare, load_study

    recipe = loaded_recipe(args)
    if not args.no_track:  # before the trace is read and the oracle built
        from omni_core.tracking import check_tracking_uri, resolve_tracking_uri

        check_tracking_uri(resolve_tracking_uri(recipe))
    try:
        study = load_study(args.recipe, args.overrides, trace=args.trace)
        plans = compare(study, args.policies or recipe.schedule.policies or [recipe.schedule.policy], args.rounds)
    except ValueError as e:  # a trace that cannot be read, a round no policy can keep
        print(f"omni: simulate: {e}", file=sys.stderr)
        return USAGE_ERROR
    out = args.out or f"{recipe.experiment.output_dir}/{recipe.experiment.name}/simulate"
    if args.no_track:
        report.save_study(plans, out)
    else:
        report.log_study(plans, recipe, out)
    if args.json:
        print(json.dumps({name: p.metrics.model_dump() for name, p in plans.items()}))
    else:
        print(report.format_table(plans))
        for issue in study.trace.issues[:20] if study.trace else ():
            print(f"  malformed row skipped: {issue}")
        print(f"  files: {out}")
    return 0
