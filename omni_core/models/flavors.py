"""Flavor registry: named architecture sizes. Adding a flavor is adding one entry to FLAVORS."""

from __future__ import annotations

from dataclasses import replace

from omni_core.models.args import AudioArgs, LLMArgs, MoEArgs, OmniModelArgs, VisionArgs

# Native-resolution ViTs (factorised positions up to 64 x 64 patches), widths chosen for the named sizes.
_VITS = {
    "vit-1b": VisionArgs(dim=2048, n_layers=20, n_heads=16),
    "vit-2.4b": VisionArgs(dim=2560, n_layers=30, n_heads=20),
    "vit-10b": VisionArgs(dim=5120, n_layers=32, n_heads=40),
}
_LLMS = {
    "llama-12b": LLMArgs(vocab_size=32000, dim=5120, n_layers=36, n_heads=40, n_kv_heads=40, ffn_hidden=13824),
    "llama-70b": LLMArgs(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672),
    # GPT-3 175B's shape in this Llama-style backbone: SwiGLU at 8/3 * dim has the params and FLOPs of GPT's
    # 4 * dim GELU MLP.
    "gpt-175b": LLMArgs(vocab_size=50257, dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, ffn_hidden=32768),
    "mixtral-8x7b": LLMArgs(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        rope_theta=1e6,
        moe=MoEArgs(num_experts=8, top_k=2),
    ),
}
# Whisper large-v3's encoder (0.63B; n_mels comes from the recipe), so every paper flavor also takes audio.
_WHISPER_LARGE_ENCODER = AudioArgs(dim=1280, n_layers=32, n_heads=20)

# The one-GPU flavors (benchmarks/gpu_check.py). omni-1b's LLM has TinyLlama-1.1B's widths (dim 2048, ffn 5632:
# Llama's rule, 8/3 * dim rounded up to 256) with 24 layers and 16 / 8 heads: 1.26B parameters. Its vocabulary is
# Llama-2's 32,000 (the byte tokenizer's 264 ids fit inside): Qwen2's 151,936 would make the embeddings 0.62B of a
# 1.75B LLM, the head a fifth of its matmul FLOPs, and the fp32 logits of one 8,192-token sequence 5 GB.
_LLM_1B = LLMArgs(vocab_size=32000, dim=2048, n_layers=24, n_heads=16, n_kv_heads=8, ffn_hidden=5632)
# Llama-3-8B exactly (8.03B parameters).
_LLM_8B = LLMArgs(
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, rope_theta=500000.0
)
# CLIP ViT-L/14's and SigLIP-L's shape (0.30B), and Qwen2-VL's ViT (0.63B), factorised positions up to 64 x 64.
_VIT_L = VisionArgs(dim=1024, n_layers=24, n_heads=16)
_VIT_600M = VisionArgs(dim=1280, n_layers=32, n_heads=16)
# Whisper small's encoder (88M with 80 mel bins) and medium's (0.31B).
_WHISPER_SMALL_ENCODER = AudioArgs(dim=768, n_layers=12, n_heads=12)
_WHISPER_MEDIUM_ENCODER = AudioArgs(dim=1024, n_layers=24, n_heads=16)

FLAVORS: dict[str, OmniModelArgs] = {
    # ~1.1M parameters: trains a few hundred steps per minute on one CPU core at seq 512.
    "debug": OmniModelArgs(
        llm=LLMArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384),
        vision=VisionArgs(dim=64, n_layers=2, n_heads=4, max_grid=64),
        audio=AudioArgs(dim=64, n_layers=2, n_heads=4),
    ),
    # ~95M parameters: the estimator's validation runs it on CPU next to `debug` (a 100x larger model).
    "small": OmniModelArgs(
        llm=LLMArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_hidden=2048),
        vision=VisionArgs(dim=384, n_layers=6, n_heads=6, max_grid=64),
        audio=AudioArgs(dim=384, n_layers=4, n_heads=6),
    ),
    # `debug`'s LLM with encoders as wide as it and twice as deep: at an image-heavy mix the encoders are a real
    # share of the step, as in the paper's workloads, so the layout benchmark can tell layouts apart. No spatial
    # merge: the data side lays out one placeholder per patch.
    "debug-enc": OmniModelArgs(
        llm=LLMArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384),
        vision=VisionArgs(dim=128, n_layers=8, n_heads=4, max_grid=64),
        audio=AudioArgs(dim=128, n_layers=8, n_heads=4),
    ),
    # `debug` with 4 routed SwiGLU experts (top-2) and a shared one in every LLM block.
    "debug-moe": OmniModelArgs(
        llm=LLMArgs(
            dim=128,
            n_layers=4,
            n_heads=4,
            n_kv_heads=2,
            ffn_hidden=192,
            moe=MoEArgs(num_experts=4, top_k=2, shared_expert=True),
        ),
        vision=VisionArgs(dim=64, n_layers=2, n_heads=4, max_grid=64),
        audio=AudioArgs(dim=64, n_layers=2, n_heads=4),
    ),
    # One GPU: omni-1b (1.67B with its encoders) is sized to train at seq_len 8,192 on one 80 GB GPU; omni-8b
    # (9.0B) is for a node's FSDP shards. One placeholder per patch (spatial_merge 1), as the data lays images out.
    "omni-1b": OmniModelArgs(llm=_LLM_1B, vision=_VIT_L, audio=_WHISPER_SMALL_ENCODER),
    "omni-8b": OmniModelArgs(llm=_LLM_8B, vision=_VIT_600M, audio=_WHISPER_MEDIUM_ENCODER),
    # Paper scale (MegaScale-Omni's workloads A-D, plus one MoE), named <vision>+<llm>, for the estimator and
    # GPUs. Shapes match omni_core.estimator.workloads (VIT_SHAPES / LLM_SHAPES, 2x2 merge before the projector).
    **{
        f"{vit}+{llm_name}": OmniModelArgs(llm=llm, vision=_VITS[vit], audio=_WHISPER_LARGE_ENCODER, spatial_merge=2)
        for vit, llm_name, llm in [
            ("vit-1b", "llama-12b", _LLMS["llama-12b"]),
            ("vit-2.4b", "llama-70b", _LLMS["llama-70b"]),
            ("vit-10b", "llama-70b", _LLMS["llama-70b"]),
            ("vit-10b", "gpt-175b", _LLMS["gpt-175b"]),
            ("vit-1b", "mixtral-8x7b", _LLMS["mixtral-8x7b"]),
        ]
    },
}


def get_flavor(name: str, *, patch_size: int, n_mels: int) -> OmniModelArgs:
    """The flavor's architecture with its input widths taken from the data recipe (patch size, mel bins)."""
    if name not in FLAVORS:
        raise ValueError(f"unknown model flavor {name!r}; known flavors: {', '.join(sorted(FLAVORS))}")
    args = FLAVORS[name]
    return replace(
        args,
        vision=replace(args.vision, patch_dim=3 * patch_size * patch_size),
        audio=replace(args.audio, n_mels=n_mels),
    )
