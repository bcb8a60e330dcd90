"""`omni export`: a trained checkpoint as a directory transformers loads with its own classes. A vision + LLM
model becomes a LLaVA directory (`models.hf_export`); the recipe names the pretrained parts whose configs,
tokenizer and image processor the export carries. Audio models (Qwen2-Audio) are refused: not built."""

from __future__ import annotations

from pathlib import Path

import torch

from omni_core.models.hf_export import ExportRefused, export_llava
from omni_core.recipe.schema import Recipe
from omni_core.runtime.checkpoint import weights_location
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.evaluate import load_model


def export_checkpoint(recipe: Recipe, checkpoint: str, out: str | Path) -> Path:
    """Write the checkpoint `checkpoint` (a step folder, a checkpoint folder's newest step, or models:/NAME@ALIAS)
    of `recipe`'s model to `out` as a transformers directory. Raises ExportRefused naming what the target class
    cannot express, CheckpointError for a location without a complete checkpoint."""
    pretrained = recipe.model.pretrained
    if pretrained.audio is not None:
        raise ExportRefused(
            f"model.pretrained.audio={pretrained.audio}: export of audio models to Qwen2-Audio is not built"
        )
    if pretrained.llm is None or pretrained.vision is None:
        raise ExportRefused(
            "export writes a LLaVA model: it needs model.pretrained.llm (its config, tokenizer and chat template) "
            "and model.pretrained.vision (its SigLIP config and image processor); the recipe names "
            + " and ".join(part for part in ("llm", "vision") if getattr(pretrained, part) is None)
            + " from no folder"
        )
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model, _ = load_model(recipe, weights_location(checkpoint, recipe, info, "CHECKPOINT"))
    return export_llava(model, pretrained.llm, pretrained.vision, out)
