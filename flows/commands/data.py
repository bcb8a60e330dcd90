"""`omni data generate`: the recipe's synthetic dataset written to disk, as a JSONL manifest with media files
or as WebDataset shards, with a progress bar on a terminal."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flows.commands.common import OVERRIDES_EPILOG, RAW, USAGE_ERROR, add_recipe_args, loaded_recipe

if TYPE_CHECKING:
    from flows.commands.common import Subparsers


def add_data(sub: Subparsers) -> None:
    data = sub.add_parser("data", help="write the recipe's synthetic dataset to disk")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    generate = data_sub.add_parser(
        "generate",
        formatter_class=RAW,
        help="write data.synthetic's samples as a JSONL manifest with media files, or WebDataset shards",
        description="Write the samples data.synthetic describes (length distributions, mix, schedule) to DIR: "
        "manifest.jsonl beside images/, video/ and audio/, or shard-NNNNNN.tar WebDataset shards of "
        "data.synthetic.shard_size samples. The same recipe writes the same bytes. With a schedule, the samples "
        "replay it in file order (sample i at step i * horizon / N).",
        epilog=OVERRIDES_EPILOG,
    )
    add_recipe_args(generate)
    generate.add_argument("--out", required=True, metavar="DIR", help="folder to write (replaced if it exists)")
    generate.add_argument("--format", choices=["jsonl", "wds"], help="default: data.synthetic.format")
    generate.add_argument("--num", type=int, metavar="N", help="samples to write (default: data.synthetic.num_samples)")
    generate.set_defaults(handler=_generate_command)


def _generate_command(args: argparse.Namespace) -> int:
    from omni_core.data.synthetic import generate_dataset

    if args.num is not None and args.num < 1:
        print(f"omni: data generate: --num must be at least 1, got {args.num}", file=sys.stderr)
        return USAGE_ERROR
    from rich.console import Console
    from rich.progress import Progress

    recipe = loaded_recipe(args)
    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("generating samples", total=args.num or recipe.data.synthetic.num_samples)
        location = generate_dataset(
            recipe, Path(args.out), lambda done, _: bar.update(task, completed=done), fmt=args.format, num=args.num
        )
    print(f"wrote {args.num or recipe.data.synthetic.num_samples} samples: {location}")
    return 0
