"""The commands that run a Prefect flow: the whole experiment (`run`), one of its stages alone (`profile`,
`train`, `evaluate`), and the flows beside it (`schedule`, `validate`, `watch`). Each checks the recipe as a
launch would before Prefect or torchrun starts, runs its flow here and prints what the flow returns."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.commands.common import (
    OVERRIDES_EPILOG,
    RAW,
    RUN_FAILED,
    USAGE_ERROR,
    add_cells_arg,
    add_recipe_args,
    checked_recipe,
)

if TYPE_CHECKING:
    from flows.commands.common import Subparsers

RUN_EPILOG = f"""\
stages (each a Prefect flow, each an MLflow child run of one parent run):
  profile   generate the synthetic dataset if it is not on disk yet (data.source=synthetic), then
            measure it: modality mix, token lengths per modality. Logs profile.json and figures.
  estimate  predicted step time and memory of the recipe's jobs on every Cell (GPU type x count x
            pipeline stages) with the best plan in each. Logs cells.json and cells.png.
  train     torchrun with parallel.nproc local ranks running omni_core.runtime.launch; rank 0
            logs train/* and perf/* metrics. Checkpoints every train.ckpt_every steps and at the end;
            continues from the newest complete checkpoint when train.resume is true (the default).
            Stopped after train.timeout_s seconds. Logs the checkpoint and train_result.json.
            parallel.plan=auto runs the estimate's best plan for this machine's Cell instead.
  evaluate  held-out loss and perplexity of the newest checkpoint, overall and per modality.
            Logs eval_report.json, eval/* metrics and a bar chart.
  schedule  instead of train and evaluate when the recipe lists `jobs`: see `omni schedule --help`.

where things go (paths relative to the directory you run omni in):
  data          <experiment.output_dir>/data/<experiment.name>       (or data.path)
  checkpoints   <experiment.output_dir>/<experiment.name>/ckpt-<training hash>/  (or train.ckpt_dir);
                the hash covers what shapes the weights (seed, data, model, optimisation), so rerunning
                a recipe resumes or finds it done, and a changed one starts afresh
  stage files   <experiment.output_dir>/<experiment.name>/runs/<MLflow run id>/
  MLflow runs   ./mlflow.db (params, metrics, tags) and ./mlartifacts/<experiment>/ (artifacts)
  experiment.output_dir defaults to ./runs. The MLflow experiment is experiment.name (or
  tracking.experiment); the parent run is named <experiment.name>-<Prefect flow run name>.

browse the results:
  mlflow ui                  in the same directory, then open http://127.0.0.1:5000
                             (another database: mlflow ui --backend-store-uri sqlite:////abs/path.db)
  --json                     prints a JSON summary (run ids, URIs, results) as the last line of stdout

{OVERRIDES_EPILOG}
real servers instead of the embedded defaults (environment variables):
  MLFLOW_TRACKING_URI     MLflow server, e.g. http://mlflow.internal:5000 (checked before anything
                          starts; tracking.uri in the recipe wins over it)
  PREFECT_API_URL         Prefect server, e.g. http://prefect.internal:4200/api; unset, Prefect runs
                          a temporary local API for the duration of the command
  AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION
                          credentials for S3 artifact and checkpoint stores
  MLFLOW_S3_ENDPOINT_URL  S3-compatible endpoint such as MinIO, e.g. http://minio.internal:9000
  OMP_NUM_THREADS         CPU threads per rank (default 1)

checks: before any stage starts, every command runs the checks of `omni recipe check` (the recipe, its
model flavor, the plan on parallel.nproc ranks, the data, the checkpoint folder, the tracking server) and
prints each problem as FILE:LINE: field: message.

exit codes: 0 done, 1 a stage failed (the end of its output is printed, then the first failing rank's
error), 2 bad usage, or a recipe a launch would refuse (bad values, missing data, unreachable server).

example:
  omni run recipes/quickstart.yaml --set train.steps=50 && mlflow ui
"""


FLOWS = {
    "run": ("flows.experiment", "experiment_flow"),
    "profile": ("flows.profile", "profile_flow"),
    "train": ("flows.train", "train_flow"),
    "evaluate": ("flows.evaluate", "evaluate_flow"),
    "schedule": ("flows.schedule", "schedule_flow"),
    "validate": ("flows.validate", "validate_flow"),
    "watch": ("flows.watch", "watch_flow"),
}

STAGES = {
    "profile": "generate the dataset if missing and profile it (modality mix, token lengths)",
    "train": "train under torchrun; checkpoints and train/* metrics go to MLflow",
    "evaluate": "evaluate the newest checkpoint on held-out data, per modality",
}


def add_run(sub: Subparsers) -> None:
    run = sub.add_parser(
        "run",
        formatter_class=RAW,
        help="run the whole experiment: profile, estimate, train, evaluate",
        description="Run the experiment flow on RECIPE: profile -> estimate -> train -> evaluate.",
        epilog=RUN_EPILOG,
    )
    add_recipe_args(run)
    run.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")
    run.set_defaults(handler=_flow_command)


def add_stages(sub: Subparsers) -> None:
    for name, text in STAGES.items():
        p = sub.add_parser(
            name,
            formatter_class=RAW,
            help=text,
            description=f"Run only the {name} stage ({text}) as its own top-level MLflow run; "
            "prints its result as JSON. `omni run --help` explains stages, paths and servers.",
            epilog=OVERRIDES_EPILOG,
        )
        add_recipe_args(p)
        if name == "profile":
            p.add_argument("--out", metavar="PATH", help="also write the profile JSON to PATH")
        if name == "train":
            add_cells_arg(p)
        p.set_defaults(handler=_flow_command)


def add_schedule(sub: Subparsers) -> None:
    schedule = sub.add_parser(
        "schedule",
        formatter_class=RAW,
        help="place the recipe's jobs on CPU slots (here, or Slurm nodes) and train them, resizing as they come and go",
        description="Real mode of the scheduler: schedule.policy places the recipe's `jobs` (model flavors; "
        "iterations = steps, arrival_s = seconds after the start) on cluster.slots CPU slots, or on a Slurm cluster's "
        "nodes (launch.target: slurm, one cpu node group naming its hosts), with the estimator "
        "as the throughput oracle, and trains each placed job with the best plan for its slots, in launches of "
        "schedule.segment_steps steps. When a job arrives or a launch ends the policy decides again; a job it "
        "shrinks or grows resumes from its checkpoint under the new plan at the end of its current launch. Logs "
        "schedule.json to the MLflow run `schedule`, each launch a child run train-<job>-<n>.",
        epilog=OVERRIDES_EPILOG,
    )
    add_recipe_args(schedule)
    add_cells_arg(schedule)
    schedule.add_argument("--json", action="store_true", help="print the schedule as JSON instead of a table")
    schedule.set_defaults(handler=_flow_command)


def add_validate(sub: Subparsers) -> None:
    validate = sub.add_parser(
        "validate",
        formatter_class=RAW,
        help="measure the estimator against real runs of many plans on this machine",
        description="Calibrate this machine (links and the runtime's wrappers on 2 ranks, kernels right before "
        "each run), train the validation plans (DP/FSDP/HSDP, TP, PP, CP, EP; world 1-4) for a few steps each "
        "on local gloo ranks "
        "and compare their step times with the estimator's predictions. estimate.validation=quick (10 plans, one "
        "round) or full (30 plans, three rounds). Logs validation.json, a predicted-vs-measured figure and the "
        "MAPE per world size to the MLflow run `validate`; prints the report as JSON.",
        epilog=OVERRIDES_EPILOG,
    )
    add_recipe_args(validate)
    validate.set_defaults(handler=_flow_command)


def add_watch(sub: Subparsers) -> None:
    watch = sub.add_parser(
        "watch",
        formatter_class=RAW,
        help="look once at the recipe's running re-planned job, and re-plan it if its data drifted",
        description="Profile the newest window of the data the running job of RECIPE's experiment reads (a job "
        "started with replan.enabled), compare it with the window its plan was chosen on, and when the drift "
        "passes replan.drift_threshold re-estimate its Cell; if the best plan is predicted to save more than a "
        "re-plan costs over the remaining steps, the job stops at its next checkpoint and its train stage "
        "relaunches it under that plan. The look is an MLflow run `replan-<step>` beside the job's train run; "
        "prints the decision as JSON. Exits 2 when no such job is running.",
        epilog=OVERRIDES_EPILOG,
    )
    add_recipe_args(watch)
    watch.set_defaults(handler=_flow_command)


def _flow_command(args: argparse.Namespace) -> int:
    recipe = checked_recipe(args)  # fail before Prefect and torchrun start
    if args.command == "schedule" or (args.command == "run" and recipe.jobs):
        from omni_core.scheduler.local import check_recipe

        try:
            check_recipe(recipe)
        except ValueError as e:
            print(f"omni: {args.command}: {e}", file=sys.stderr)
            return USAGE_ERROR
    module, name = FLOWS[args.command]
    flow = getattr(importlib.import_module(module), name)
    from omni_core.runtime.supervisor import LaunchError

    extra = {}
    if getattr(args, "cells", None):
        from pydantic import ValidationError

        from omni_core.estimator.search import CellTable

        try:
            extra["cells"] = CellTable.load(args.cells)
        except ValidationError as e:
            print(
                f"omni: --cells {args.cells}: not a CellTable ({e.error_count()} problems, first: "
                f"{'.'.join(map(str, e.errors()[0]['loc']))}: {e.errors()[0]['msg']})",
                file=sys.stderr,
            )
            return USAGE_ERROR
    try:
        result = flow(args.recipe, args.overrides, **extra)
    except LaunchError as e:
        print(f"omni: {args.command} failed: {e}", file=sys.stderr)
        return RUN_FAILED
    except ValueError as e:
        if args.command != "watch":
            raise
        print(f"omni: watch: {e}", file=sys.stderr)  # no job to look at
        return USAGE_ERROR
    _print_result(args, result)
    return 0


def _print_result(args: argparse.Namespace, result: Any) -> None:
    """The experiment's summary (or its JSON), the schedule's table, or the flow's result as JSON; `--out`
    also writes that JSON to a file."""
    if args.command == "run":
        if args.json:
            print(json.dumps(result))
        else:
            _print_summary(result)
        return
    if getattr(args, "out", None):
        Path(args.out).write_text(result.to_json())
    if args.command == "schedule" and not args.json:
        from omni_core.scheduler.local import format_run

        print(format_run(result))
    else:
        print(result.to_json())


def _print_summary(summary: dict[str, Any]) -> None:
    print(f"experiment {summary['experiment_name']!r}: MLflow run {summary['run_name']} ({summary['parent_run_id']})")
    if "schedule" in summary:
        from omni_core.scheduler.local import ScheduleRun, format_run

        print("  schedule  " + format_run(ScheduleRun.model_validate(summary["schedule"])).replace("\n", "\n  "))
    else:
        train, report = summary["train"], summary["evaluate"]
        per_modality = ", ".join(f"{m} {s['loss']:.3f}" for m, s in report["per_modality"].items())
        answers = "".join(
            f"\n            {m} answers: exact {t['answer_exact_match']:.2f}, token F1 {t['answer_token_f1']:.2f} "
            f"({t['samples']} generated)"
            for m, t in report.get("task", {}).items()
        )
        print(
            f"  train     {train['steps']} steps, loss {train['initial_loss']:.3f} -> {train['final_loss']:.3f}, "
            f"{train['tokens_per_s']:.0f} tokens/s, plan {train['plan']}\n"
            f"            checkpoint {train['checkpoint']}\n"
            f"  evaluate  loss {report['loss']:.3f} (perplexity {report['perplexity']:.2f}); {per_modality}{answers}"
        )
    print(f"  tracking  {summary['tracking_uri']}\n  browse    {_browse_hint(summary)}")


def _browse_hint(summary: dict[str, Any]) -> str:
    """How to see the runs: the tracking server's page, or `mlflow ui` on the local store, opened at the
    experiment's training runs (tracking.ui.runs_page_url)."""
    uri = summary["tracking_uri"]
    page = summary.get("runs_page") or "http://127.0.0.1:5000"
    if uri.startswith(("http://", "https://")):
        return f"open {page}"
    if uri == f"sqlite:///{Path.cwd() / 'mlflow.db'}":
        return f"mlflow ui   then open {page}"
    return f"mlflow ui --backend-store-uri {uri}   then open {page}"
