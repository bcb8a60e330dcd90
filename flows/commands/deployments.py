"""`omni serve` and `omni deploy`: prefect.yaml's deployments served from this process, or registered with a
work pool (`flows.deploy` does the work)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flows.commands.common import USAGE_ERROR

if TYPE_CHECKING:
    from flows.commands.common import Subparsers


def add_serve_and_deploy(sub: Subparsers) -> None:
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
        p.set_defaults(handler=_deployments_command)
    deploy.add_argument("--pool", default="omni-process", help="work pool name (default: omni-process)")
    deploy.add_argument(
        "--type",
        dest="pool_type",
        choices=["process", "kubernetes"],
        default="process",
        help="work pool type when it is created (default: process)",
    )


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
