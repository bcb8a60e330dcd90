"""`omni export`: a checkpoint as a directory transformers loads (`omni_core.runtime.export`)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from flows.commands.common import OVERRIDES_EPILOG, RAW, USAGE_ERROR, add_recipe_args, loaded_recipe

if TYPE_CHECKING:
    from flows.commands.common import Subparsers


def add_export(sub: Subparsers) -> None:
    export = sub.add_parser(
        "export",
        formatter_class=RAW,
        epilog=OVERRIDES_EPILOG,
        help="write a checkpoint as a transformers LLaVA or Qwen2-Audio directory (weights, config, tokenizer, "
        "processor)",
        description="Write CHECKPOINT of RECIPE's model to --to as a directory that transformers loads "
        "(from_pretrained): LlavaForConditionalGeneration and LlavaProcessor for a vision + LLM model, "
        "Qwen2AudioForConditionalGeneration and Qwen2AudioProcessor for an audio + LLM one. What the class cannot "
        "express is refused by name: a spatial merge, model.vision_final_norm true, projector_mult != 1 (LLaVA); "
        "model.audio_pool other than 2, model.audio_projector other than linear (Qwen2-Audio); both towers.",
    )
    add_recipe_args(export)
    export.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a step folder (…/step_NNNNNN), a checkpoint folder (its newest complete step) or models:/NAME@ALIAS",
    )
    export.add_argument("--to", required=True, metavar="DIR", help="the directory to write")
    export.set_defaults(handler=_export_command)


def _export_command(args: argparse.Namespace) -> int:
    from omni_core.models.hf_export import ExportRefused
    from omni_core.runtime.export import export_checkpoint

    try:
        out, target = export_checkpoint(loaded_recipe(args), args.checkpoint, args.to)
    except ExportRefused as e:
        print(f"omni: {e}", file=sys.stderr)
        return USAGE_ERROR
    print(f"exported {args.checkpoint} to {out} ({target})")
    return 0
