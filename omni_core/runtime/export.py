"""`omni export`: a trained checkpoint as a directory transformers loads with its own classes. A vision + LLM
model becomes a LLaVA directory (`models.hf_export`), an audio + LLM model a Qwen2-Audio one
(`models.hf_export_audio`); the recipe names the pretrained parts whose configs, tokenizer and processor the
export carries. A model with both towers is refused: no transformers class here holds a SigLIP tower and a
Whisper encoder together."""

from __future__ import annotations

from pathlib import Path

import torch

from omni_core.models.hf_export import ExportRefused, export_llava
from omni_core.models.hf_export_audio import export_qwen2_audio
from omni_core.recipe.schema import Recipe
from omni_core.runtime.checkpoint import weights_location
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.evaluate import load_model


def export_target(recipe: Recipe) -> str:
    """The transformers class the recipe's model exports as, from its pretrained parts; raises ExportRefused
    naming the parts for a model no class can hold."""
    pretrained = recipe.model.pretrained
    if pretrained.vision is not None and pretrained.audio is not None:
        raise ExportRefused(
            f"model.pretrained.vision={pretrained.vision} and model.pretrained.audio={pretrained.audio}: a model "
            "with a vision tower and an audio encoder has no transformers class to export to (LLaVA holds only "
            "the vision tower, Qwen2-Audio only the audio encoder)"
        )
    tower = "vision" if pretrained.audio is None else "audio"
    missing = [part for part in ("llm", tower) if getattr(pretrained, part) is None]
    if missing:
        raise ExportRefused(
            "export writes a LLaVA model (model.pretrained.llm and model.pretrained.vision: its SigLIP config and "
            "image processor) or a Qwen2-Audio model (model.pretrained.llm and model.pretrained.audio: its Whisper "
            "config and feature extractor), each with the LLM's config, tokenizer and chat template; the recipe "
            f"names {' and '.join(missing)} from no folder"
        )
    return "LlavaForConditionalGeneration" if tower == "vision" else "Qwen2AudioForConditionalGeneration"


def export_checkpoint(recipe: Recipe, checkpoint: str, out: str | Path) -> tuple[Path, str]:
    """Write the checkpoint `checkpoint` (a step folder, a checkpoint folder's newest step, or models:/NAME@ALIAS)
    of `recipe`'s model to `out` as a transformers directory; returns it and its class. Raises ExportRefused
    naming what the target class cannot express, CheckpointError for a location without a complete
    checkpoint."""
    target = export_target(recipe)  # before any checkpoint is looked for
    pretrained = recipe.model.pretrained
    assert pretrained.llm is not None  # export_target refuses a recipe without it
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model, _ = load_model(recipe, weights_location(checkpoint, recipe, info, "CHECKPOINT"))
    if pretrained.audio is not None:
        return export_qwen2_audio(model, pretrained.llm, pretrained.audio, out), target
    assert pretrained.vision is not None
    return export_llava(model, pretrained.llm, pretrained.vision, out), target
