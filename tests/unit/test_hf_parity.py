"""Our LLM / ViT / audio encoder against the transformers reference implementations, given the same random
weights (moved through safetensors files in the HF layouts), and the checks on such files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    SiglipVisionConfig,
    SiglipVisionModel,
    WhisperConfig,
)
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from omni_core.models.args import AudioArgs, LLMArgs, VisionArgs
from omni_core.models.audio import AudioEncoder
from omni_core.models.hf_import import export_safetensors, load_safetensors
from omni_core.models.llm import LLM
from omni_core.models.vision import VisionEncoder

TOL = {"rtol": 0, "atol": 1e-5}
LLM_SHAPE = {"vocab_size": 96, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 96,
             "rope_theta": 5e5}


def hf_llm_config(cls, args: LLMArgs):
    return cls(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_hidden,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta, max_position_embeddings=128,
        tie_word_embeddings=False, attn_implementation="eager",
    )


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random values everywhere (norm weights and biases too), so every tensor mapping is exercised."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.ndim > 1 else 0.5) + (1.0 if p.ndim == 1 else 0))


@pytest.mark.parametrize("layout", ["llama", "qwen2"])
def test_llm_matches_transformers(layout: str, tmp_path: Path) -> None:
    args = LLMArgs(**LLM_SHAPE, qkv_bias=layout == "qwen2")
    cls, config_cls = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[layout]
    reference = cls(hf_llm_config(config_cls, args)).eval()
    randomize(reference)
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, tmp_path / "model.safetensors")
    ours = LLM(args)
    load_safetensors(ours, tmp_path / "model.safetensors", layout)

    # Two packed documents against two separate reference calls: parity and document masking at once.
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, args.vocab_size, (n,), generator=gen) for n in (11, 7)]
    with torch.no_grad():
        expected = torch.cat([reference(input_ids=d[None]).logits[0] for d in docs])
        ids = torch.cat(docs)
        positions = torch.cat([torch.arange(len(d)) for d in docs])
        logits = ours(ours.embed(ids), positions, torch.tensor([0, 11, 18]))
    torch.testing.assert_close(logits, expected, **TOL)

    # Export round trip: the file we write loads strictly into the reference class, bit for bit.
    export_safetensors(ours, tmp_path / "ours.safetensors", layout)
    exported = load_file(tmp_path / "ours.safetensors")
    assert exported.keys() == reference.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in reference.state_dict().items())


def test_siglip_vit_matches_transformers(tmp_path: Path) -> None:
    config = SiglipVisionConfig(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=32,
        patch_size=8, vision_use_head=False, attn_implementation="eager",
    )
    reference = SiglipVisionModel(config).eval()
    randomize(reference)
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, tmp_path / "vit.safetensors")
    args = VisionArgs(patch_dim=3 * 8 * 8, dim=48, n_layers=2, n_heads=4, mlp_ratio=2.0, pos_embed="absolute",
                      max_grid=4, activation="gelu_tanh", norm_eps=config.layer_norm_eps)
    ours = VisionEncoder(args)
    load_safetensors(ours, tmp_path / "vit.safetensors", "siglip")

    def patchify(pixels: torch.Tensor) -> torch.Tensor:  # [3, H, W] -> row-major (c, y, x) patches
        rows, cols = pixels.shape[1] // 8, pixels.shape[2] // 8
        return pixels.view(3, rows, 8, cols, 8).permute(1, 3, 0, 2, 4).reshape(rows * cols, -1)

    gen = torch.Generator().manual_seed(2)
    native, wide = torch.rand(3, 32, 32, generator=gen) * 2 - 1, torch.rand(3, 24, 40, generator=gen) * 2 - 1
    with torch.no_grad():
        expected = torch.cat([
            reference(native[None]).last_hidden_state[0],  # its native 4 x 4 grid
            reference(wide[None], interpolate_pos_encoding=True).last_hidden_state[0],  # 3 x 5, resampled
        ])
        got = ours(torch.cat([patchify(native), patchify(wide)]), torch.tensor([[4, 4], [3, 5]]))
    torch.testing.assert_close(got, expected, **TOL)

    export_safetensors(ours, tmp_path / "ours.safetensors", "siglip")
    exported = load_file(tmp_path / "ours.safetensors")
    key_bias = "encoder.layers.0.self_attn.k_proj.bias"  # dropped on import (softmax cancels it), zeros on export
    assert exported.keys() == reference.state_dict().keys() and not exported[key_bias].any()
    assert all(torch.equal(exported[k], v) for k, v in reference.state_dict().items() if "k_proj.bias" not in k)


def test_whisper_encoder_matches_transformers(tmp_path: Path) -> None:
    config = WhisperConfig(d_model=48, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=96,
                           num_mel_bins=16, max_source_positions=20, attn_implementation="eager")
    reference = WhisperEncoder(config).eval()
    positions = reference.embed_positions.weight.clone()
    randomize(reference)
    with torch.no_grad():
        reference.embed_positions.weight.copy_(positions)  # Whisper's fixed sinusoids: not a learned table
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, tmp_path / "whisper.safetensors")
    ours = AudioEncoder(AudioArgs(n_mels=16, dim=48, n_layers=2, n_heads=4, mlp_ratio=2.0, max_frames=40))
    load_safetensors(ours, tmp_path / "whisper.safetensors", "whisper")

    mels = torch.randn(40, 16, generator=torch.Generator().manual_seed(3))  # HF takes exactly 2 x 20 frames
    with torch.no_grad():
        expected = reference(mels.T[None]).last_hidden_state[0]
        got = ours(mels, torch.tensor([40]))
    torch.testing.assert_close(got, expected, **TOL)

    export_safetensors(ours, tmp_path / "ours.safetensors", "whisper")
    exported = load_file(tmp_path / "ours.safetensors")
    assert exported.keys() == reference.state_dict().keys()
    torch.testing.assert_close(exported["embed_positions.weight"], positions, rtol=0, atol=1e-6)

    randomize(reference, seed=9)  # a learned (non-sinusoidal) position table cannot be represented: refused
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, tmp_path / "learned.safetensors")
    with pytest.raises(ValueError, match="'embed_positions.weight' differs"):
        load_safetensors(ours, tmp_path / "learned.safetensors", "whisper")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), r"missing tensor 'model.layers.1.mlp.up_proj.weight'"),
        (lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}),
         r"unexpected tensor 'model.layers.0.extra"),
        (lambda t: t.update({"model.norm.weight": torch.ones(63)}), r"'model.norm.weight' has shape \(63,\), expected"),
    ],
    ids=["missing", "extra", "mis-shaped"],
)
def test_bad_checkpoints_are_refused_naming_the_tensor(edit, message, tmp_path: Path) -> None:
    ours = LLM(LLMArgs(**LLM_SHAPE))
    export_safetensors(ours, tmp_path / "good.safetensors", "llama")
    tensors = load_file(tmp_path / "good.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "bad.safetensors")
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with torch.no_grad():
        ours.norm.weight.fill_(3.0)
        before["norm.weight"].fill_(3.0)
    with pytest.raises(ValueError, match=message) as error:
        load_safetensors(ours, tmp_path / "bad.safetensors", "llama")
    assert "bad.safetensors" in str(error.value)
    assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())  # nothing was copied


def test_layout_must_fit_the_module(tmp_path: Path) -> None:
    qwen = LLM(LLMArgs(**LLM_SHAPE, qkv_bias=True))
    export_safetensors(qwen, tmp_path / "qwen.safetensors", "qwen2")
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        load_safetensors(LLM(LLMArgs(**LLM_SHAPE)), tmp_path / "qwen.safetensors", "llama")
    with pytest.raises(TypeError, match="layout 'siglip' is for a VisionEncoder"):
        load_safetensors(qwen, tmp_path / "qwen.safetensors", "siglip")
    with pytest.raises(ValueError, match="'row_embed.weight' of this VisionEncoder has no name"):
        export_safetensors(VisionEncoder(VisionArgs()), tmp_path / "vit.safetensors", "siglip")
