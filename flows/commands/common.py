"""What every command group shares: the exit codes, the RECIPE and --set arguments and their help, and the
recipe they name, loaded as it is or checked as a launch would check it."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omni_core.recipe import Recipe

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]  # what each group's `add_*` adds to

USAGE_ERROR = 2  # argparse's code for bad usage; also bad recipes, missing files, unreachable servers
RUN_FAILED = 1

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

RAW = argparse.RawDescriptionHelpFormatter  # the epilogs and descriptions keep their own line breaks


def add_recipe_args(p: argparse.ArgumentParser, what: str = "recipe YAML file") -> None:
    p.add_argument("recipe", metavar="RECIPE", help=what)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)


def add_cells_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cells",
        metavar="PATH",
        help="the estimate stage's CellTable JSON (`omni estimate --out`): "
        "what parallel.plan=auto and the scheduler's oracle use instead of estimating again",
    )


def loaded_recipe(args: argparse.Namespace) -> Recipe:
    """The recipe of RECIPE and --set, resolved, unchecked."""
    from omni_core.recipe import load_recipe

    return load_recipe(args.recipe, args.overrides)


def checked_recipe(args: argparse.Namespace, study: bool = False) -> Recipe:
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
