"""`omni recipe check` and `omni recipe show`: a recipe checked as a launch would check it, or printed as
resolved (extends and overrides applied), without running anything."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from flows.commands.common import OVERRIDES_EPILOG, RAW, add_recipe_args, checked_recipe, loaded_recipe

if TYPE_CHECKING:
    from flows.commands.common import Subparsers
    from omni_core.recipe import Recipe


def add_recipe(sub: Subparsers) -> None:
    recipe = sub.add_parser("recipe", help="check or show a recipe without running anything")
    recipe_sub = recipe.add_subparsers(dest="recipe_command", required=True, metavar="ACTION")
    check = recipe_sub.add_parser(
        "check",
        formatter_class=RAW,
        epilog=OVERRIDES_EPILOG,
        help="run every check a launch would (values, model flavor, plan, data, checkpoints, tracking) "
        "and a study's schedule.trace; "
        "prints `ok <hash>`, or each problem as FILE:LINE: field: message and exits 2",
    )
    add_recipe_args(check)
    check.set_defaults(handler=_check_command)
    show = recipe_sub.add_parser(
        "show",
        formatter_class=RAW,
        help="print the resolved recipe (extends and overrides applied) and its hash",
        epilog=OVERRIDES_EPILOG,
    )
    add_recipe_args(show)
    show.set_defaults(handler=_show_command)


def _check_command(args: argparse.Namespace) -> int:
    from omni_core.recipe import recipe_hash

    print(f"ok {recipe_hash(checked_recipe(args, study=True))}")
    return 0


def _show_command(args: argparse.Namespace) -> int:
    from omni_core.recipe import dump_recipe, recipe_hash

    recipe = loaded_recipe(args)
    print(dump_recipe(recipe).rstrip("\n"))
    print(f"# recipe.hash: {recipe_hash(recipe)}")
    print(f"# parallel plan: {_plan_line(recipe)}")
    return 0


def _plan_line(recipe: Recipe) -> str:
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
