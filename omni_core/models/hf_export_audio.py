"""An omni audio + LLM model as a transformers Qwen2-Audio directory: `Qwen2AudioForConditionalGeneration` and
`Qwen2AudioProcessor` load it (from_pretrained) and give omni's logits for a clip that fills the extractor's
chunk.

Qwen2-Audio's tower is Whisper's encoder with `avg_pooler` (pairs of the blocks' outputs averaged, before the
final norm) and a stored position table; its projector is one Linear. A model trained with `model.audio_pool: 2`
and `model.audio_projector: linear` is that (`AudioEncoder.finish`, `LinearProjector`); the encoder's weights
keep Whisper's names (`hf_import`'s whisper layout) under `model.audio_tower.`, its computed sinusoids become
`embed_positions`. What Qwen2-Audio cannot express is refused by name (`ExportRefused`), never approximated.

The one convention that differs: transformers runs the conv stem over the whole padded chunk (chunk_length
seconds of the extractor), omni over the clip's own frames. The stem's last output (conv1 at the clip's last
frame, read by conv2's last window) therefore sees the log-mel of the padding after a clip in transformers and
zeros in omni, so the clip's last LLM embedding, and through attention the rest slightly, differ for a clip
shorter than the chunk; a clip that fills the chunk has no padding, and the two agree exactly (to float error).
Token counts agree for every clip of an even number L of feature frames (omni rounds frames down to even;
transformers' processor gives ((L - 1) // 2 + 1 - 2) // 2 + 1 = L // 4 audio tokens, `batch.audio_tokens`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omni_core.common.tokenizer import HFTokenizer
from omni_core.models import hf_config, hf_import
from omni_core.models.hf_export import (
    PREPROCESSOR,
    ExportRefused,
    host_copies,
    llm_tensors,
    read_llm,
    read_preprocessor,
    write_directory,
)
from omni_core.models.omni import OmniModel

QWEN2_AUDIO_POOL = 2  # Qwen2AudioEncoder.avg_pooler: AvgPool1d(2, stride=2)
WHISPER_DEFAULTS = {"chunk_length": 30, "sampling_rate": 16000, "hop_length": 160}  # WhisperFeatureExtractor's
QWEN2_AUDIO_NORM_EPS = 1e-5  # its LayerNorms' eps (nn.LayerNorm's default, not configurable)


def qwen2_audio_problems(model: OmniModel) -> list[str]:
    """Why `model` cannot be a Qwen2AudioForConditionalGeneration (empty: it can)."""
    args, problems = model.args, []
    if args.audio.pool != QWEN2_AUDIO_POOL:
        problems.append(
            f"audio pool={args.audio.pool}: Qwen2-Audio averages pairs of the encoder's outputs (avg_pooler) "
            "before its final norm (train with model.audio_pool=2)"
        )
    if args.audio_projector != "linear":
        problems.append(
            f"audio_projector={args.audio_projector!r}: Qwen2-Audio's projector is one Linear "
            "(train with model.audio_projector=linear)"
        )
    if args.audio.norm_eps != QWEN2_AUDIO_NORM_EPS:
        problems.append(f"audio norm_eps={args.audio.norm_eps}: Qwen2-Audio's encoder LayerNorms use 1e-05")
    return problems


def qwen2_audio_tensors(model: OmniModel, llm_layout: str) -> dict[str, torch.Tensor]:
    """The audio encoder, audio projector and LLM under Qwen2AudioForConditionalGeneration's names. Qwen2-Audio
    ties no head to the embedding: a tied LLM's head is written as its embedding's copy."""
    tensors = {f"model.audio_tower.{name}": t for name, t in hf_import.hf_state_dict(model.audio, "whisper").items()}
    tensors.update(llm_tensors(model, llm_layout))
    if model.args.llm.tied_embeddings:
        tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"]
    linear = model.projectors["audio"].get_submodule("linear")
    for kind in ("weight", "bias"):
        tensors[f"model.multi_modal_projector.linear.{kind}"] = linear.get_parameter(kind)
    return host_copies(tensors)


def qwen2_audio_config(model: OmniModel, llm_type: str, tokenizer: HFTokenizer) -> dict[str, Any]:
    """Qwen2AudioConfig as a dict: the encoder's Whisper config as a qwen2_audio_encoder, the LLM's text_config,
    the audio placeholder's id."""
    audio = {**hf_config.audio_config(model.args.audio), "model_type": "qwen2_audio_encoder"}
    return {
        "architectures": ["Qwen2AudioForConditionalGeneration"],
        "model_type": "qwen2_audio",
        "audio_config": {**audio, "scale_embedding": False, "dropout": 0.0, "encoder_layerdrop": 0.0},
        "text_config": hf_config.llm_config(model.args.llm, llm_type),
        "audio_token_index": tokenizer.placeholder_ids["audio"],
        "tie_word_embeddings": False,  # Qwen2-Audio has no tied head: `qwen2_audio_tensors` writes one
        "dtype": "float32",
    }


def chunk_frames(preprocessor: dict[str, Any]) -> int:
    """Feature frames of the WhisperFeatureExtractor's chunk (its defaults where the config omits a key), the
    length it pads every clip to."""
    seconds, rate, hop = (preprocessor.get(k, d) for k, d in WHISPER_DEFAULTS.items())
    return int(seconds * rate // hop)


def export_qwen2_audio(model: OmniModel, llm_dir: str | Path, audio_dir: str | Path, out: str | Path) -> Path:
    """Write `model` (its audio encoder from `audio_dir`, its LLM and tokenizer from `llm_dir`, as the recipe's
    model.pretrained names them) to `out` as a Qwen2-Audio directory: config.json, model.safetensors, the
    tokenizer with the media placeholders, preprocessor_config.json (the encoder's WhisperFeatureExtractor) and
    processor_config.json (`audio_token`: omni's placeholder, which the chat template writes and the processor
    expands). Raises ExportRefused naming each setting Qwen2-Audio cannot express."""
    llm_dir, audio_dir, out = Path(llm_dir), Path(audio_dir), Path(out)
    if problems := qwen2_audio_problems(model):
        raise ExportRefused("cannot export as Qwen2AudioForConditionalGeneration: " + "; ".join(problems))
    preprocessor = read_preprocessor(audio_dir, "the Whisper encoder's feature extractor config")
    chunk = chunk_frames(preprocessor)
    if chunk != model.args.audio.max_frames:
        raise ExportRefused(
            f"{audio_dir / PREPROCESSOR}: a chunk of {chunk} feature frames is not the encoder's "
            f"2 x max_source_positions = {model.args.audio.max_frames}: Qwen2-Audio's encoder takes exactly one "
            "chunk, its position table that long"
        )
    llm_type, layout, tokenizer = read_llm(llm_dir)
    write_directory(
        out,
        qwen2_audio_tensors(model, layout),
        qwen2_audio_config(model, llm_type, tokenizer),
        llm_dir,
        tokenizer,
        preprocessor=preprocessor,
        processor={
            "processor_class": "Qwen2AudioProcessor",
            "audio_token": tokenizer.backend.id_to_token(tokenizer.placeholder_ids["audio"]),
        },
    )
    return out
