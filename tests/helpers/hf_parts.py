"""Tiny pretrained parts for the tests, written by transformers from configs with random weights: a Qwen2 (or
Llama) LLM, a SigLIP vision tower and a Whisper encoder (saved inside a whole Whisper model, as the hub ships
them), each a checkpoint directory that `recipe.model.pretrained` can name. Their input widths fit the tests'
recipes (tests.helpers.models: 8-pixel patches, 32 mel bins); the LLM comes with its tokenizer, the towers with
the processor config (preprocessor_config.json) that their data is prepared by."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    SiglipVisionConfig,
    SiglipVisionModel,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
)
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from tests.helpers.hf_tokenizer import write_tokenizer
from tests.helpers.models import N_MELS, PATCH_SIZE

LLM_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}


def write_llm(folder: Path, *, kind: str = "qwen2", tied: bool = False, seed: int = 0, vocab_size: int = 0) -> Path:
    """An LLM with its tokenizer (tests.helpers.hf_tokenizer, ChatML); its vocabulary is the tokenizer's
    (`vocab_size`: another), without omni's media placeholders, which the recipe's tokenizer adds."""
    from tokenizers import Tokenizer

    write_tokenizer(folder)
    vocab_size = vocab_size or Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(seed)
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[kind]
    config = config_cls(**{**LLM_SHAPE, "vocab_size": vocab_size}, tie_word_embeddings=tied)
    model_cls(config).save_pretrained(folder)
    return folder


def write_vision(folder: Path, *, seed: int = 1) -> Path:
    torch.manual_seed(seed)
    config = SiglipVisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                image_size=8 * PATCH_SIZE, patch_size=PATCH_SIZE, vision_use_head=False)
    SiglipVisionModel(config).save_pretrained(folder)
    size = {"height": config.image_size, "width": config.image_size}
    SiglipImageProcessorPil(size=size).save_pretrained(folder)
    return folder


def write_audio(folder: Path, *, seed: int = 2, chunk_length: int = 30) -> Path:
    """A Whisper encoder and its feature extractor, whose chunk of `chunk_length` seconds (30: Whisper's) is the
    encoder's 2 x max_source_positions frames (100 per second)."""
    torch.manual_seed(seed)
    config = WhisperConfig(d_model=48, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=96,
                           decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=32, vocab_size=64,
                           pad_token_id=1, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                           num_mel_bins=N_MELS, max_source_positions=50 * chunk_length)
    WhisperForConditionalGeneration(config).save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=N_MELS, chunk_length=chunk_length).save_pretrained(folder)
    return folder


def write_parts(root: Path, **llm: object) -> dict[str, str]:
    """All three parts under `root`, as `model.pretrained` names them (`llm`: `write_llm`'s options)."""
    return {"llm": str(write_llm(root / "llm", **llm)),  # type: ignore[arg-type]
            "vision": str(write_vision(root / "vision")), "audio": str(write_audio(root / "audio"))}


def with_added_rows(stored: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A file's tensor as a model whose tokenizer added tokens holds it: the added rows the mean of the file's."""
    extra = shape[0] - stored.shape[0]
    return torch.cat([stored, stored.mean(0, keepdim=True).expand(extra, *stored.shape[1:])]) if extra else stored
