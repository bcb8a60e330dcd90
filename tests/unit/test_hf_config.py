"""Checkpoints written by transformers from configs with random weights, read back by `load_pretrained`: for
every setting of config.json that omni honours, our logits equal transformers'; every other one is refused
naming the file, the key and the value. And `save_pretrained` writes what transformers loads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    SiglipVisionConfig,
    SiglipVisionModel,
    WhisperConfig,
    WhisperForConditionalGeneration,
)
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from omni_core.models.flops import llm_params
from omni_core.models.hf_config import ConfigRefused
from omni_core.models.hf_import import load_pretrained, save_pretrained
from omni_core.models.llm import LLM

TOL = {"rtol": 0, "atol": 1e-4}
SHAPE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
DOCS = (40, 11)  # the first longer than the windows and the pre-training contexts below


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.ndim > 1 else 0.5) + (1.0 if p.ndim == 1 else 0))


def written(config, tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    """A transformers model of `config` with random weights, saved as a checkpoint directory."""
    config._attn_implementation = "eager"
    reference = AutoModelForCausalLM.from_config(config).eval()
    randomize(reference)
    reference.save_pretrained(tmp_path / "hf")
    return reference, tmp_path / "hf"


def packed_logits(ours: LLM, docs: list[torch.Tensor]) -> torch.Tensor:
    ids = torch.cat(docs)
    positions = torch.cat([torch.arange(len(d)) for d in docs])
    offsets = torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0).tolist()])
    with torch.no_grad():
        return ours(ours.embed(ids), positions, offsets)


def reference_logits(reference: torch.nn.Module, docs: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([reference(input_ids=d[None]).logits[0] for d in docs])


def documents(vocab: int = 96) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in DOCS]


HONOURED = {
    "llama theta 2.5e5, eps 1e-6": LlamaConfig(**SHAPE, rms_norm_eps=1e-6, rope_parameters={
        "rope_type": "default", "rope_theta": 2.5e5}),
    "llama rope linear x4": LlamaConfig(**SHAPE, rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                                  "rope_theta": 1e4}),
    "llama rope llama3 x8": LlamaConfig(**SHAPE, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 5e5}),
    "llama rope yarn x4": LlamaConfig(**SHAPE, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4}),
    "llama hidden_act gelu": LlamaConfig(**SHAPE, hidden_act="gelu"),
    "llama hidden_act gelu_pytorch_tanh": LlamaConfig(**SHAPE, hidden_act="gelu_pytorch_tanh"),
    "llama tied embeddings": LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "qwen2 tied embeddings": Qwen2Config(**SHAPE, tie_word_embeddings=True),
    "qwen2 sliding window 16 from layer 1": Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=16,
                                                         max_window_layers=1),
    "mistral sliding window 8": MistralConfig(**SHAPE, sliding_window=8),
    "mixtral 4 experts top-2": MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2),
    "qwen2-moe shared expert, no renormalisation": Qwen2MoeConfig(
        **SHAPE, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False),
    "qwen2-moe renormalised": Qwen2MoeConfig(
        **SHAPE, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True),
}


@pytest.mark.parametrize("config", HONOURED.values(), ids=HONOURED.keys())
def test_honoured_settings_give_transformers_logits(config, tmp_path: Path) -> None:
    reference, directory = written(config, tmp_path)
    ours, _ = load_pretrained(directory, "llm")
    docs = documents()
    torch.testing.assert_close(packed_logits(ours, docs), reference_logits(reference, docs), **TOL)


@pytest.mark.parametrize("name", ["llama rope yarn x4", "qwen2 sliding window 16 from layer 1",
                                  "llama tied embeddings", "mixtral 4 experts top-2",
                                  "qwen2-moe shared expert, no renormalisation"])
def test_save_pretrained_loads_back_into_transformers(name: str, tmp_path: Path) -> None:
    reference, directory = written(HONOURED[name], tmp_path)
    ours, _ = load_pretrained(directory, "llm")
    save_pretrained(ours, tmp_path / "ours", HONOURED[name].model_type)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    docs = documents()
    torch.testing.assert_close(reference_logits(again, docs), reference_logits(reference, docs), **TOL)


def test_a_null_in_the_file_is_not_the_model_types_default():
    from omni_core.models.hf_config import llm_args_from_config

    config = {"model_type": "mistral", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    assert llm_args_from_config(config, "c.json")[0].sliding_window == 4096  # left out: Mistral's default
    assert llm_args_from_config({**config, "sliding_window": None}, "c.json")[0].sliding_window is None


def test_tied_head_is_the_embedding(tmp_path: Path) -> None:
    _, directory = written(HONOURED["qwen2 tied embeddings"], tmp_path)
    ours, _ = load_pretrained(directory, "llm")
    assert ours.output.weight is ours.tok_embeddings.weight
    assert sum(p.numel() for p in ours.parameters()) == llm_params(ours.args)  # counted once, here and in FLOPs


REFUSED = {
    "dynamic rope": (LlamaConfig(**SHAPE, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
                     r"rope_parameters.rope_type='dynamic': transformers recomputes it"),
    "longrope": (LlamaConfig(**SHAPE, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                       "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                                       "original_max_position_embeddings": 16}),
                 r"rope_parameters.rope_type='longrope'"),
    "head_dim": (LlamaConfig(**SHAPE, head_dim=32), r"head_dim=32: omni's attention heads are .* 16 wide"),
    "attention bias": (LlamaConfig(**SHAPE, attention_bias=True), r"attention_bias=True"),
    "mlp bias": (LlamaConfig(**SHAPE, mlp_bias=True), r"mlp_bias=True"),
    "router jitter": (MixtralConfig(**SHAPE, num_local_experts=4, router_jitter_noise=0.1),
                      r"router_jitter_noise=0.1: omni's router adds no noise"),
    "dense layers in qwen2-moe": (Qwen2MoeConfig(**SHAPE, moe_intermediate_size=32, num_experts=4,
                                                 decoder_sparse_step=2), r"decoder_sparse_step=2"),
}


@pytest.mark.parametrize("config, message", REFUSED.values(), ids=REFUSED.keys())
def test_settings_omni_cannot_honour_are_refused_by_name(config, message: str, tmp_path: Path) -> None:
    _, directory = written(config, tmp_path)
    with pytest.raises(ConfigRefused, match=message) as error:
        load_pretrained(directory, "llm")
    assert str(directory / "config.json") in str(error.value)


def test_a_key_omni_does_not_read_is_refused(tmp_path: Path) -> None:
    _, directory = written(LlamaConfig(**SHAPE), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq"}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigRefused, match=r"quantization_config=\{'quant_method': 'gptq'\}: not a setting"):
        load_pretrained(directory, "llm")


def test_rotary_buffers_in_a_file_are_ignored_as_transformers_does(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    reference, directory = written(LlamaConfig(**SHAPE), tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    ours, _ = load_pretrained(directory, "llm")
    torch.testing.assert_close(packed_logits(ours, documents()), reference_logits(reference, documents()), **TOL)


@pytest.mark.parametrize("activation", ["gelu", "gelu_pytorch_tanh"])
def test_siglip_activation_is_read(activation: str, tmp_path: Path) -> None:
    config = SiglipVisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8, hidden_act=activation, attn_implementation="eager")
    reference = SiglipVisionModel(config).eval()
    randomize(reference)
    reference.save_pretrained(tmp_path / "vit")
    ours, _ = load_pretrained(tmp_path / "vit", "vision")
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    patches = pixels[0].view(3, 4, 8, 4, 8).permute(1, 3, 0, 2, 4).reshape(16, -1)
    save_pretrained(ours, tmp_path / "ours")
    again = SiglipVisionModel.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(pixels).last_hidden_state[0]
        torch.testing.assert_close(ours(patches, torch.tensor([[4, 4]])), expected, **TOL)
        torch.testing.assert_close(again(pixels).last_hidden_state[0], expected, **TOL)


def test_clip_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip_vision_model", "hidden_size": 48}))
    with pytest.raises(ConfigRefused, match="model_type='clip_vision_model'.*CLIP's class token"):
        load_pretrained(tmp_path, "vision")


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_whisper_encoder_activation_is_read(activation: str, tmp_path: Path) -> None:
    config = WhisperConfig(d_model=48, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=96,
                           decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=32, vocab_size=64, pad_token_id=1,
                           bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                           num_mel_bins=16, max_source_positions=20, activation_function=activation,
                           attn_implementation="eager")
    reference = WhisperForConditionalGeneration(config).eval()
    encoder = reference.model.encoder
    positions = encoder.embed_positions.weight.clone()
    randomize(reference)
    with torch.no_grad():
        encoder.embed_positions.weight.copy_(positions)
    reference.save_pretrained(tmp_path / "whisper")
    ours, _ = load_pretrained(tmp_path / "whisper", "audio")
    mels = torch.randn(40, 16, generator=torch.Generator().manual_seed(3))
    save_pretrained(ours, tmp_path / "ours")
    again = WhisperEncoder.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    with torch.no_grad():
        expected = encoder(mels.T[None]).last_hidden_state[0]
        torch.testing.assert_close(ours(mels, torch.tensor([40])), expected, **TOL)
        torch.testing.assert_close(again(mels.T[None]).last_hidden_state[0], expected, **TOL)
