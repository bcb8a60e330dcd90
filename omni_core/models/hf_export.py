"""An omni vision + LLM model as a transformers LLaVA directory: `LlavaForConditionalGeneration.from_pretrained`
and `LlavaProcessor.from_pretrained` load it and give the logits omni gives; and what every export shares (the
LLM under `model.language_model.`, the tokenizer with omni's placeholders, the chat template), which the
Qwen2-Audio export (`hf_export_audio`) uses too.

The parts keep their import layouts (`hf_import`), under LLaVA's prefixes; omni's image projector is LLaVA's
`multi_modal_projector` (linear_1, GELU, linear_2). What LLaVA cannot express is refused by name (`ExportRefused`),
never approximated: a spatial merge, features after the tower's final norm, a projector whose hidden width is
not the LLM's, a tower without SigLIP's position table.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from omni_core.common.tokenizer import HFTokenizer
from omni_core.models import hf_config, hf_import
from omni_core.models.flops import projector_dims
from omni_core.models.omni import OmniModel

# The LLM directory's files the export carries (tokenizer.json is rewritten with the added tokens)
CARRIED_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
PREPROCESSOR = "preprocessor_config.json"  # a tower's processor config, as transformers saves it


class ExportRefused(ValueError):
    """The model holds something the target transformers class cannot express."""


def llava_problems(model: OmniModel) -> list[str]:
    """Why `model` cannot be a LlavaForConditionalGeneration (empty: it can)."""
    args, problems = model.args, []
    if args.spatial_merge != 1:
        problems.append(f"spatial_merge={args.spatial_merge}: LLaVA feeds one image token per patch (no merge)")
    if args.vision.final_norm:
        problems.append(
            "vision final_norm=True: the projector reads the tower's output after its final LayerNorm, LLaVA "
            "reads hidden_states[-1] before it (train with the vision tower's final_norm off)"
        )
    if args.vision.pos_embed != "absolute":
        problems.append(f"vision pos_embed={args.vision.pos_embed!r}: LLaVA's SigLIP tower has one absolute table")
    hidden = projector_dims(args)["image"][1]
    if hidden != args.llm.dim:
        problems.append(
            f"image projector hidden width {hidden} != LLM dim {args.llm.dim}: LLaVA's linear_1 maps to the "
            "LLM's width (projector_mult must be 1)"
        )
    return problems


def llm_tensors(model: OmniModel, llm_layout: str) -> dict[str, torch.Tensor]:
    """The LLM under the names of transformers' MLLM classes (LLaVA, Qwen2-Audio): `model.language_model.` and
    the top-level `lm_head`."""
    return {
        name if name == "lm_head.weight" else name.replace("model.", "model.language_model.", 1): t
        for name, t in hf_import.hf_state_dict(model.llm, llm_layout).items()
    }


def host_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies, as safetensors writes them (tied tensors become separate copies)."""
    return {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}


def llava_tensors(model: OmniModel, llm_layout: str) -> dict[str, torch.Tensor]:
    """The model's vision tower, image projector and LLM under LlavaForConditionalGeneration's names."""
    tensors = {
        f"model.vision_tower.vision_model.{name}": t
        for name, t in hf_import.hf_state_dict(model.vision, "siglip").items()
    }
    tensors.update(llm_tensors(model, llm_layout))
    projector = model.projectors["image"]
    for ours, theirs in (("fc1", "linear_1"), ("fc2", "linear_2")):
        for kind in ("weight", "bias"):
            tensors[f"model.multi_modal_projector.{theirs}.{kind}"] = getattr(projector, ours).get_parameter(kind)
    return host_copies(tensors)


def llava_config(model: OmniModel, llm_type: str, tokenizer: HFTokenizer, image_tokens: int) -> dict[str, Any]:
    """LlavaConfig as a dict: SigLIP vision_config, the LLM's text_config, the `<image>` id, GELU projector."""
    text = hf_config.llm_config(model.args.llm, llm_type)
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "vision_config": hf_config.vision_config(model.args.vision),
        "text_config": text,
        "image_token_index": tokenizer.placeholder_ids["image"],
        "image_seq_length": image_tokens,
        "projector_hidden_act": "gelu",  # omni's Projector: exact GELU
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",  # SigLIP has no class token to drop
        "multimodal_projector_bias": True,
        "tie_word_embeddings": model.args.llm.tied_embeddings,
        "dtype": "float32",
    }


def export_llava(model: OmniModel, llm_dir: str | Path, vision_dir: str | Path, out: str | Path) -> Path:
    """Write `model` (its vision tower from `vision_dir`, its LLM and tokenizer from `llm_dir`, as the recipe's
    model.pretrained names them) to `out` as a LLaVA directory: config.json, model.safetensors, the tokenizer
    with the media placeholders, preprocessor_config.json and processor_config.json. Raises ExportRefused
    naming each setting LLaVA cannot express."""
    llm_dir, vision_dir, out = Path(llm_dir), Path(vision_dir), Path(out)
    if problems := llava_problems(model):
        raise ExportRefused("cannot export as LlavaForConditionalGeneration: " + "; ".join(problems))
    processor = read_preprocessor(vision_dir, "the SigLIP tower's image processor config")
    llm_type, layout, tokenizer = read_llm(llm_dir)
    patch = round((model.args.vision.patch_dim // 3) ** 0.5)
    side = model.args.vision.max_grid * patch
    if processor.get("size") != {"height": side, "width": side}:
        raise ExportRefused(
            f"{vision_dir / PREPROCESSOR}: size {processor.get('size')} is not the tower's image_size {side}: "
            "LLaVA adds SigLIP's position table as is, without resampling it to another grid"
        )
    image_tokens = model.args.vision.max_grid**2
    write_directory(
        out,
        llava_tensors(model, layout),
        llava_config(model, llm_type, tokenizer, image_tokens),
        llm_dir,
        tokenizer,
        preprocessor=processor,
        processor={
            "processor_class": "LlavaProcessor",
            "patch_size": patch,
            "vision_feature_select_strategy": "full",
            "num_additional_image_tokens": 0,
            "image_token": tokenizer.backend.id_to_token(tokenizer.placeholder_ids["image"]),
        },
    )
    return out


def read_preprocessor(tower_dir: Path, what: str) -> dict[str, Any]:
    """The tower's preprocessor_config.json (`what` it is, for the error of a missing one)."""
    preprocessor = tower_dir / PREPROCESSOR
    if not preprocessor.is_file():
        raise FileNotFoundError(f"{preprocessor}: missing ({what})")
    return dict(json.loads(preprocessor.read_text()))


def read_llm(llm_dir: Path) -> tuple[str, str, HFTokenizer]:
    """The pretrained LLM's model_type, its tensors' layout and its tokenizer (with omni's placeholders)."""
    llm_config, _ = hf_config.read_config(llm_dir)
    _, layout = hf_config.llm_args_from_config(llm_config, str(llm_dir / "config.json"))
    return str(llm_config.get("model_type")), layout, HFTokenizer.from_pretrained(llm_dir)


def write_directory(
    out: Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    llm_dir: Path,
    tokenizer: HFTokenizer,
    *,
    preprocessor: dict[str, Any],
    processor: dict[str, Any],
) -> None:
    """A transformers MLLM directory: weights, config, the LLM's tokenizer files with the placeholders the model
    trained with, its chat template as the processors read it, and the processor's two configs (the tower's
    preprocessor config tagged with `processor["processor_class"]`)."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    for name in CARRIED_FILES:
        if (llm_dir / name).is_file():
            shutil.copyfile(llm_dir / name, out / name)
    if tokenizer.chat_template and not (out / "chat_template.jinja").is_file():
        # the processors read their template from this file only (a tokenizer's may sit in tokenizer_config.json)
        (out / "chat_template.jinja").write_text(tokenizer.chat_template)
    tokenizer.backend.save(str(out / "tokenizer.json"))  # with the placeholders the model was trained with
    _write_json(out / "generation_config.json", generation_config(llm_dir, tokenizer))
    _write_json(out / "preprocessor_config.json", {**preprocessor, "processor_class": processor["processor_class"]})
    _write_json(out / "processor_config.json", processor)


def generation_config(llm_dir: Path, tokenizer: HFTokenizer) -> dict[str, Any]:
    """The LLM's generation_config.json with the tokenizer's EOS among its stop ids: replies were trained to end
    there (`data.conversation.chat_renderer`) and omni's evaluation stops there, so transformers' `generate`
    does too, whatever the base checkpoint's config lists."""
    path = llm_dir / "generation_config.json"
    config: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    listed = config.get("eos_token_id")
    stops = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    if tokenizer.eos_id not in stops:
        stops.append(tokenizer.eos_id)
    config["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    config.setdefault("pad_token_id", tokenizer.pad_id)
    return config


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
