"""`omni`: the command line. Thin: parses, runs every check a launch would up front (`runtime.preflight`:
the recipe, its model, plan, data, checkpoints and tracking server; so mistakes cost seconds and print as
`FILE:LINE: field: message`, not a traceback), then calls a flow or the library. MLflow and Prefect are
imported only by the commands that need them, so `omni --help` and `omni recipe check` answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

USAGE_ERROR = 2  # argparse's code for bad usage; also bad recipes, missing files, unreachable servers
RUN_FAILED = 1
INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C, as a shell reports it
BROKEN_PIPE = 128 + signal.SIGPIPE  # what the shell reports for a tool whose reader left (`omni ... | head`)

SET_HELP = "override one recipe value by its dotted path (repeatable), e.g. --set train.steps=50"

OVERRIDES_EPILOG = """\
overrides:
  --set KEY=VALUE changes one value of the recipe by its dotted path; repeat it for several.
  VALUE is read as YAML (numbers, true/false, lists, {maps}); quote it for the shell when needed:
    --set train.steps=50 --set parallel.nproc=2
    --set data.synthetic.num_samples=500 --set 'data.synthetic.mix={text: 0.5, image: 0.5}'
    --set experiment.output_dir=/scratch/omni --set tracking.experiment=my-sweep
  `omni recipe show RECIPE --set ...` prints the result without running anything.
"""

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


def _add_recipe_args(p: argparse.ArgumentParser, what: str = "recipe YAML file") -> None:
    p.add_argument("recipe", metavar="RECIPE", help=what)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)


def _add_cells_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cells",
        metavar="PATH",
        help="the estimate stage's CellTable JSON (`omni estimate --out`): "
        "what parallel.plan=auto and the scheduler's oracle use instead of estimating again",
    )


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="omni",
        formatter_class=raw,
        description="Train multimodal LLMs from a recipe: profile -> train -> evaluate as Prefect flows, "
        "every metric, figure and checkpoint in MLflow.",
        epilog="Start with: omni run --help",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        formatter_class=raw,
        help="run the whole experiment: profile, estimate, train, evaluate",
        description="Run the experiment flow on RECIPE: profile -> estimate -> train -> evaluate.",
        epilog=RUN_EPILOG,
    )
    _add_recipe_args(run)
    run.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")

    stages = {
        "profile": "generate the dataset if missing and profile it (modality mix, token lengths)",
        "train": "train under torchrun; checkpoints and train/* metrics go to MLflow",
        "evaluate": "evaluate the newest checkpoint on held-out data, per modality",
    }
    for name, text in stages.items():
        p = sub.add_parser(
            name,
            formatter_class=raw,
            help=text,
            description=f"Run only the {name} stage ({text}) as its own top-level MLflow run; "
            "prints its result as JSON. `omni run --help` explains stages, paths and servers.",
            epilog=OVERRIDES_EPILOG,
        )
        _add_recipe_args(p)
        if name == "profile":
            p.add_argument("--out", metavar="PATH", help="also write the profile JSON to PATH")
        if name == "train":
            _add_cells_arg(p)

    estimate = sub.add_parser(
        "estimate",
        formatter_class=raw,
        help="predict step time and memory of the recipe's jobs on every Cell of its cluster",
        description="Enumerate Cells (GPU type x GPU count x nodes x pipeline stages) for the recipe's jobs "
        "(`jobs:`, or its own model), search the best plan in each and print them ranked by throughput. "
        "The cluster is `cluster.node_groups`, else `estimate.gpu_types` up to `estimate.max_gpus`. "
        "No MLflow run (`omni run` logs the stage).",
        epilog=OVERRIDES_EPILOG,
    )
    _add_recipe_args(estimate)
    estimate.add_argument("--profile", metavar="PATH", help="a DatasetProfile JSON (document lengths, encoder tokens)")
    estimate.add_argument("--out", metavar="PATH", help="write the CellTable JSON to PATH")
    estimate.add_argument("--json", action="store_true", help="print the CellTable as JSON instead of a table")

    simulate = sub.add_parser(
        "simulate",
        formatter_class=raw,
        help="replay a job trace on the recipe's cluster under scheduling policies, side by side",
        description="Simulate the recipe's cluster in rounds of schedule.round_s seconds with the estimator as "
        "the throughput oracle: the recipe's jobs, or a trace (Crius, ITP or Philly CSV; raw traces are mapped "
        "to model jobs with schedule.trace_seed). Prints jobs finished, mean throughput, JCT, decision latency "
        "per policy; writes SchedulePlan JSONs and figures to --out and logs them to MLflow (run `simulate`).",
        epilog=OVERRIDES_EPILOG,
    )
    _add_recipe_args(simulate)
    simulate.add_argument("--trace", metavar="PATH", help="trace CSV instead of schedule.trace")
    simulate.add_argument(
        "--policy",
        dest="policies",
        action="append",
        metavar="NAME",
        choices=["crius", "fcfs", "gavel", "sia"],
        help="policy to run (repeatable); default: schedule.policies, else schedule.policy",
    )
    simulate.add_argument("--rounds", type=int, metavar="N", help="rounds to simulate (default schedule.max_rounds)")
    simulate.add_argument(
        "--out", metavar="DIR", help="directory for the JSONs and figures (default <output_dir>/<experiment>/simulate)"
    )
    simulate.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    simulate.add_argument("--json", action="store_true", help="print per-policy metrics as JSON instead of a table")

    schedule = sub.add_parser(
        "schedule",
        formatter_class=raw,
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
    _add_recipe_args(schedule)
    _add_cells_arg(schedule)
    schedule.add_argument("--json", action="store_true", help="print the schedule as JSON instead of a table")

    validate = sub.add_parser(
        "validate",
        formatter_class=raw,
        help="measure the estimator against real runs of many plans on this machine",
        description="Calibrate this machine (links and the runtime's wrappers on 2 ranks, kernels right before "
        "each run), train the validation plans (DP/FSDP/HSDP, TP, PP, CP, EP; world 1-4) for a few steps each on local gloo ranks "
        "and compare their step times with the estimator's predictions. estimate.validation=quick (10 plans, one "
        "round) or full (30 plans, three rounds). Logs validation.json, a predicted-vs-measured figure and the "
        "MAPE per world size to the MLflow run `validate`; prints the report as JSON.",
        epilog=OVERRIDES_EPILOG,
    )
    _add_recipe_args(validate)

    watch = sub.add_parser(
        "watch",
        formatter_class=raw,
        help="look once at the recipe's running re-planned job, and re-plan it if its data drifted",
        description="Profile the newest window of the data the running job of RECIPE's experiment reads (a job "
        "started with replan.enabled), compare it with the window its plan was chosen on, and when the drift "
        "passes replan.drift_threshold re-estimate its Cell; if the best plan is predicted to save more than a "
        "re-plan costs over the remaining steps, the job stops at its next checkpoint and its train stage "
        "relaunches it under that plan. The look is an MLflow run `replan-<step>` beside the job's train run; "
        "prints the decision as JSON. Exits 2 when no such job is running.",
        epilog=OVERRIDES_EPILOG,
    )
    _add_recipe_args(watch)

    data = sub.add_parser("data", help="write the recipe's synthetic dataset to disk")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    generate = data_sub.add_parser(
        "generate",
        formatter_class=raw,
        help="write data.synthetic's samples as a JSONL manifest with media files, or WebDataset shards",
        description="Write the samples data.synthetic describes (length distributions, mix, schedule) to DIR: "
        "manifest.jsonl beside images/, video/ and audio/, or shard-NNNNNN.tar WebDataset shards of "
        "data.synthetic.shard_size samples. The same recipe writes the same bytes. With a schedule, the samples "
        "replay it in file order (sample i at step i * horizon / N).",
        epilog=OVERRIDES_EPILOG,
    )
    _add_recipe_args(generate)
    generate.add_argument("--out", required=True, metavar="DIR", help="folder to write (replaced if it exists)")
    generate.add_argument("--format", choices=["jsonl", "wds"], help="default: data.synthetic.format")
    generate.add_argument("--num", type=int, metavar="N", help="samples to write (default: data.synthetic.num_samples)")

    recipe = sub.add_parser("recipe", help="check or show a recipe without running anything")
    recipe_sub = recipe.add_subparsers(dest="recipe_command", required=True, metavar="ACTION")
    check = recipe_sub.add_parser(
        "check",
        formatter_class=raw,
        epilog=OVERRIDES_EPILOG,
        help="run every check a launch would (values, model flavor, plan, data, checkpoints, tracking) "
        "and a study's schedule.trace; "
        "prints `ok <hash>`, or each problem as FILE:LINE: field: message and exits 2",
    )
    _add_recipe_args(check)
    show = recipe_sub.add_parser(
        "show",
        formatter_class=raw,
        help="print the resolved recipe (extends and overrides applied) and its hash",
        epilog=OVERRIDES_EPILOG,
    )
    _add_recipe_args(show)

    serve = sub.add_parser(
        "serve",
        help="serve prefect.yaml's deployments (schedules included) from this process",
        description="Serve every deployment of the deployments file until interrupted: its "
        "schedules create flow runs, which run here. Needs PREFECT_API_URL (a Prefect server).",
    )
    deploy = sub.add_parser(
        "deploy",
        help="register prefect.yaml's deployments with a work pool",
        description="Register every deployment of the deployments file with the work pool POOL "
        "(created when missing). A process pool's worker (`prefect worker start --pool POOL`) "
        "runs their flow runs from this checkout; a kubernetes pool's (infra/k8s/prefect-worker"
        ".yaml) starts each as a Job in the training image, from infra/k8s/base-job-template.json.",
    )
    for p in (serve, deploy):
        p.add_argument("--file", type=Path, help="deployments file (default: the repository's prefect.yaml)")
    deploy.add_argument("--pool", default="omni-process", help="work pool name (default: omni-process)")
    deploy.add_argument(
        "--type",
        dest="pool_type",
        choices=["process", "kubernetes"],
        default="process",
        help="work pool type when it is created (default: process)",
    )

    render = sub.add_parser(
        "render",
        formatter_class=raw,
        epilog=OVERRIDES_EPILOG,
        help="print one launch of RECIPE for a cluster: a Kubernetes Job, a Kubeflow TrainJob or a Slurm script",
        description="Render the launch of RECIPE (parallel.nproc ranks over --nodes nodes) as "
        "Kubernetes manifests (YAML: a headless Service and an Indexed Job), a Kubeflow Trainer "
        "TrainJob (on the torch-distributed runtime), a Slurm sbatch script, or the local "
        "torchrun command. Paths are where the launch runs.",
    )
    _add_recipe_args(render)
    render.add_argument("--target", choices=["kubernetes", "trainjob", "slurm", "local"], required=True)
    render.add_argument("--nodes", type=int, default=1, help="nodes; parallel.nproc must be a multiple")
    render.add_argument("--name", help="run name (default: the experiment's name)")
    render.add_argument("--image", default="omni-train:latest", help="Kubernetes, TrainJob: the training image")
    render.add_argument("--gpus-per-node", type=int, default=0)
    render.add_argument("--cpus-per-node", type=int, default=8)
    render.add_argument("--memory-gb", type=int, default=32)
    render.add_argument("--result", default="train_result.json", help="where rank 0 writes its result")
    return parser


def _load(args: argparse.Namespace) -> Any:
    from omni_core.recipe import load_recipe

    return load_recipe(args.recipe, args.overrides)


def _checked(args: argparse.Namespace, study: bool = False) -> Any:
    """The recipe, refused (RecipeError: exit 2) with every problem a launch of it would meet (and, for
    `study`, its schedule.trace a simulation would read); warnings printed."""
    from omni_core.recipe import load_located
    from omni_core.runtime.preflight import check_launch

    recipe, locations = load_located(args.recipe, args.overrides)
    for warning in check_launch(recipe, locations):
        print(f"omni: {warning}", file=sys.stderr)
    if study and recipe.schedule.trace:
        from omni_core.scheduler.study import checked_trace

        checked_trace(recipe, locations)
    return recipe


def _recipe_command(args: argparse.Namespace) -> int:
    from omni_core.recipe import dump_recipe, recipe_hash

    if args.recipe_command == "check":
        print(f"ok {recipe_hash(_checked(args, study=True))}")
        return 0
    recipe = _load(args)
    print(dump_recipe(recipe).rstrip("\n"))
    print(f"# recipe.hash: {recipe_hash(recipe)}")
    print(f"# parallel plan: {_plan_line(recipe)}")
    return 0


def _plan_line(recipe) -> str:
    """The plan the recipe runs on its parallel.nproc ranks, by compact name (encoders' layout included)."""
    from omni_core.common.plan import ParallelPlan, PlanError

    if recipe.parallel.plan == "auto":
        return "auto (the estimate stage's best plan for the train stage's Cell)"
    try:
        return (
            f"{ParallelPlan.from_config(recipe.parallel, recipe.parallel.nproc).name} on {recipe.parallel.nproc} ranks"
        )
    except PlanError as err:
        return f"does not fit parallel.nproc={recipe.parallel.nproc}: {err}"


FLOWS = {
    "run": ("flows.experiment", "experiment_flow"),
    "profile": ("flows.profile", "profile_flow"),
    "train": ("flows.train", "train_flow"),
    "evaluate": ("flows.evaluate", "evaluate_flow"),
    "schedule": ("flows.schedule", "schedule_flow"),
    "validate": ("flows.validate", "validate_flow"),
    "watch": ("flows.watch", "watch_flow"),
}


def _browse_hint(uri: str) -> str:
    if uri.startswith(("http://", "https://")):
        return f"open {uri}"
    if uri == f"sqlite:///{Path.cwd() / 'mlflow.db'}":
        return "mlflow ui   then open http://127.0.0.1:5000"
    return f"mlflow ui --backend-store-uri {uri}   then open http://127.0.0.1:5000"


def _print_summary(summary: dict[str, Any]) -> None:
    print(f"experiment {summary['experiment_name']!r}: MLflow run {summary['run_name']} ({summary['parent_run_id']})")
    if "schedule" in summary:
        from omni_core.scheduler.local import ScheduleRun, format_run

        print("  schedule  " + format_run(ScheduleRun.model_validate(summary["schedule"])).replace("\n", "\n  "))
    else:
        train, report = summary["train"], summary["evaluate"]
        per_modality = ", ".join(f"{m} {s['loss']:.3f}" for m, s in report["per_modality"].items())
        print(
            f"  train     {train['steps']} steps, loss {train['initial_loss']:.3f} -> {train['final_loss']:.3f}, "
            f"{train['tokens_per_s']:.0f} tokens/s, plan {train['plan']}\n"
            f"            checkpoint {train['checkpoint']}\n"
            f"  evaluate  loss {report['loss']:.3f} (perplexity {report['perplexity']:.2f}); {per_modality}"
        )
    print(f"  tracking  {summary['tracking_uri']}\n  browse    {_browse_hint(summary['tracking_uri'])}")


def _flow_command(args: argparse.Namespace) -> int:
    recipe = _checked(args)  # fail before Prefect and torchrun start
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
    if args.command == "run":
        if args.json:
            print(json.dumps(result))
        else:
            _print_summary(result)
        return 0
    if getattr(args, "out", None):
        Path(args.out).write_text(result.to_json())
    if args.command == "schedule" and not args.json:
        from omni_core.scheduler.local import format_run

        print(format_run(result))
    else:
        print(result.to_json())
    return 0


def _estimate_command(args: argparse.Namespace) -> int:
    from omni_core.estimator.recipe_cells import estimate_recipe, format_table

    profile = None
    if args.profile:
        from omni_core.data.profile import DatasetProfile

        profile = DatasetProfile.load(args.profile)
    try:
        table = estimate_recipe(_load(args), profile)
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

    recipe = _load(args)
    if not args.no_track:  # before the trace is read and the oracle built
        from omni_core.tracking import check_tracking_uri, resolve_tracking_uri

        check_tracking_uri(resolve_tracking_uri(recipe))
    try:
        study = load_study(args.recipe, args.overrides, trace=args.trace)
    except ValueError as e:
        print(f"omni: simulate: {e}", file=sys.stderr)
        return USAGE_ERROR
    plans = compare(study, args.policies or recipe.schedule.policies or [recipe.schedule.policy], args.rounds)
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


def _data_command(args: argparse.Namespace) -> int:
    from omni_core.data.synthetic import generate_dataset

    if args.num is not None and args.num < 1:
        print(f"omni: data generate: --num must be at least 1, got {args.num}", file=sys.stderr)
        return USAGE_ERROR
    from rich.console import Console
    from rich.progress import Progress

    recipe = _load(args)
    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("generating samples", total=args.num or recipe.data.synthetic.num_samples)
        location = generate_dataset(
            recipe, Path(args.out), lambda done, _: bar.update(task, completed=done), fmt=args.format, num=args.num
        )
    print(f"wrote {args.num or recipe.data.synthetic.num_samples} samples: {location}")
    return 0


def _deployments_command(args: argparse.Namespace) -> int:
    from flows.deploy import DEPLOYMENTS_FILE, DeploymentError, deploy, load_deployments, serve

    try:
        specs = load_deployments(args.file or DEPLOYMENTS_FILE)
        if args.command == "serve":
            serve(specs)
            return 0
        for spec, deployment_id in zip(specs, deploy(specs, args.pool, args.pool_type), strict=True):
            print(f"{spec.flow().name}/{spec.name} -> {args.pool_type} work pool {args.pool} ({deployment_id})")
    except DeploymentError as e:
        print(f"omni: {e}", file=sys.stderr)
        return USAGE_ERROR
    return 0


def _render_command(args: argparse.Namespace) -> int:
    import yaml

    from omni_core.runtime.targets import (
        RunSpec,
        kubernetes_manifests,
        local_command,
        run_name,
        slurm_script,
        trainjob_manifest,
    )

    recipe = _checked(args)
    nproc = recipe.parallel.nproc
    if args.nodes < 1 or nproc % args.nodes:
        print(f"omni: render: parallel.nproc={nproc} ranks do not split over --nodes {args.nodes}", file=sys.stderr)
        return USAGE_ERROR
    try:
        spec = RunSpec(
            name=args.name or run_name(recipe.experiment.name),
            recipe=str(args.recipe),
            result=args.result,
            nodes=args.nodes,
            ranks_per_node=nproc // args.nodes,
            image=args.image,
            cpus_per_node=args.cpus_per_node,
            memory_gb=args.memory_gb,
            gpus_per_node=args.gpus_per_node,
            max_restarts=recipe.train.max_restarts,
            overrides=tuple(args.overrides),
        )
    except ValueError as e:
        print(f"omni: render: {e}", file=sys.stderr)
        return USAGE_ERROR
    if args.target == "kubernetes":
        print(yaml.safe_dump_all(kubernetes_manifests(spec), sort_keys=False), end="")
    elif args.target == "trainjob":
        print(yaml.safe_dump(trainjob_manifest(spec), sort_keys=False), end="")
    elif args.target == "slurm":
        print(slurm_script(spec), end="")
    else:
        print(shlex.join(local_command(spec)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _command(args)
    except BrokenPipeError:  # the reader left (`| head`): nothing more to say, and nowhere to say it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return BROKEN_PIPE


def _command(args: argparse.Namespace) -> int:
    from omni_core.recipe import RecipeError
    from omni_core.runtime.ckpt_store import CheckpointError
    from omni_core.tracking import TrackingError

    try:
        if args.command == "recipe":
            return _recipe_command(args)
        if args.command == "estimate":
            return _estimate_command(args)
        if args.command == "simulate":
            return _simulate_command(args)
        if args.command == "data":
            return _data_command(args)
        if args.command in ("serve", "deploy"):
            return _deployments_command(args)
        if args.command == "render":
            return _render_command(args)
        return _flow_command(args)
    except KeyboardInterrupt:  # the supervisor has killed any launch's process group by now
        print("omni: interrupted", file=sys.stderr)
        return INTERRUPTED
    except (RecipeError, TrackingError, CheckpointError) as e:
        print(f"omni: {e}", file=sys.stderr)
    except FileNotFoundError as e:
        print(f"omni: no such file: {e.filename}" if e.filename else f"omni: {e}", file=sys.stderr)
    return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
