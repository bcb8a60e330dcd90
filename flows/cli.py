"""`omni`: the command line. Thin: parses, runs every check a launch would up front (`runtime.preflight`:
the recipe, its model, plan, data, checkpoints and tracking server; so mistakes cost seconds and print as
`FILE:LINE: field: message`, not a traceback), then calls a flow or the library. Each command group's parser
and handler live in `flows.commands`; this module assembles them and maps what a handler raises to one line
and an exit code. MLflow and Prefect are imported only by the commands that need them, so `omni --help` and
`omni recipe check` answer at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from flows.commands import data, deployments, export, planning, recipe, render, stages
from flows.commands.common import USAGE_ERROR

if TYPE_CHECKING:
    from flows.commands.common import Subparsers

INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C, as a shell reports it
BROKEN_PIPE = 128 + signal.SIGPIPE  # what the shell reports for a tool whose reader left (`omni ... | head`)

# Each adds its commands, in the order `omni --help` lists them.
COMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    stages.add_run,
    stages.add_stages,
    planning.add_estimate,
    planning.add_simulate,
    stages.add_schedule,
    stages.add_validate,
    stages.add_watch,
    data.add_data,
    recipe.add_recipe,
    deployments.add_serve_and_deploy,
    render.add_render,
    export.add_export,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train multimodal LLMs from a recipe: profile -> train -> evaluate as Prefect flows, "
        "every metric, figure and checkpoint in MLflow.",
        epilog="Start with: omni run --help",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


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
        return args.handler(args)  # the one its command's parser set
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
