"""`omni render`: one launch of a recipe written out for a cluster (Kubernetes manifests, a Kubeflow
TrainJob, a Slurm sbatch script) or as the local torchrun command, by `omni_core.runtime.targets`."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import TYPE_CHECKING

from flows.commands.common import OVERRIDES_EPILOG, RAW, USAGE_ERROR, add_recipe_args, checked_recipe

if TYPE_CHECKING:
    from flows.commands.common import Subparsers


def add_render(sub: Subparsers) -> None:
    render = sub.add_parser(
        "render",
        formatter_class=RAW,
        epilog=OVERRIDES_EPILOG,
        help="print one launch of RECIPE for a cluster: a Kubernetes Job, a Kubeflow TrainJob or a Slurm script",
        description="Render the launch of RECIPE (parallel.nproc ranks over --nodes nodes) as "
        "Kubernetes manifests (YAML: a headless Service and an Indexed Job), a Kubeflow Trainer "
        "TrainJob (on the torch-distributed runtime), a Slurm sbatch script, or the local "
        "torchrun command. Paths are where the launch runs.",
    )
    add_recipe_args(render)
    render.add_argument("--target", choices=["kubernetes", "trainjob", "slurm", "local"], required=True)
    render.add_argument("--nodes", type=int, default=1, help="nodes; parallel.nproc must be a multiple")
    render.add_argument("--name", help="run name (default: the experiment's name)")
    render.add_argument("--image", default="omni-train:latest", help="Kubernetes, TrainJob: the training image")
    render.add_argument("--gpus-per-node", type=int, default=0)
    render.add_argument("--cpus-per-node", type=int, default=8)
    render.add_argument("--memory-gb", type=int, default=32)
    render.add_argument("--result", default="train_result.json", help="where rank 0 writes its result")
    render.set_defaults(handler=_render_command)


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

    recipe = checked_recipe(args)
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
