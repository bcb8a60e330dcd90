"""Parameter and FLOP counts from args: against built modules, torch's FLOP counter and hand counts."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from omni_core.models.args import LLMArgs, MoEArgs
from omni_core.models.flavors import FLAVORS, get_flavor
from omni_core.models.flops import (
    attention_pairs,
    audio_params,
    llm_flops_per_token,
    llm_forward_flops,
    llm_params,
    omni_params,
    omni_train_flops,
    vision_params,
)
from omni_core.models.omni import OmniModel
from tests.helpers.models import MIXED_DOCS, N_MELS, PATCH_SIZE, VIDEO_DOCS, make_batch


@pytest.mark.parametrize("flavor", ["debug", "debug-moe", "small", "omni-1b", "omni-8b"])
def test_param_counts_equal_the_built_modules(flavor: str) -> None:
    args = get_flavor(flavor, patch_size=PATCH_SIZE, n_mels=N_MELS)
    with torch.device("meta"):
        model = OmniModel(args)
    counts = omni_params(args)
    for part in ("vision", "audio", "projectors", "llm"):
        assert counts[part] == sum(p.numel() for p in getattr(model, part).parameters()), part
    assert counts["total"] == model.num_params()


def test_paper_flavor_param_counts_by_hand() -> None:
    flavor = {name: get_flavor(name, patch_size=14, n_mels=128) for name in FLAVORS if "+" in name}
    assert len(flavor) == 5
    # Published totals: Llama-2-70B and Mixtral-8x7B.
    assert llm_params(flavor["vit-2.4b+llama-70b"].llm) == 68_976_648_192
    assert llm_params(flavor["vit-1b+mixtral-8x7b"].llm) == 46_702_792_704
    d, f, v = 12288, 32768, 50257  # GPT-3 175B's shape (SwiGLU at 8/3 d)
    assert llm_params(flavor["vit-10b+gpt-175b"].llm) == 96 * (4 * d * d + 3 * d * f + 2 * d) + 2 * v * d + d
    d, h = 2048, 8192  # ViT-1B: patch embed (14x14x3), 2 x 64 position rows, 20 blocks, final LayerNorm
    block = 2 * 2 * d + (4 * d * d + 3 * d) + (d * h + h + h * d + d)
    assert vision_params(flavor["vit-1b+llama-12b"].vision) == 588 * d + d + 2 * 64 * d + 20 * block + 2 * d
    assert 13e9 < omni_params(flavor["vit-1b+llama-12b"])["total"] < 14e9


def encoder_block_by_hand(d: int, h: int) -> int:
    """Two LayerNorms, q/v/o with biases and k without, and the MLP's two biased linears."""
    return 2 * 2 * d + (4 * d * d + 3 * d) + (d * h + h + h * d + d)


def test_gpu_flavor_param_counts_by_hand() -> None:
    one, eight = (get_flavor(name, patch_size=14, n_mels=80) for name in ("omni-1b", "omni-8b"))
    assert llm_params(eight.llm) == 8_030_261_248  # Llama-3-8B's published count
    d, kv, f, v = 2048, 8 * 128, 5632, 32000  # omni-1b: 16 query heads of 128, 8 KV heads
    assert llm_params(one.llm) == 24 * (2 * d * d + 2 * d * kv + 3 * d * f + 2 * d) + 2 * v * d + d == 1_263_634_432
    d = 1024  # ViT-L/14: patch embed (14 x 14 x 3), 2 x 64 position rows, 24 blocks, final LayerNorm
    assert vision_params(one.vision) == 588 * d + d + 2 * 64 * d + 24 * encoder_block_by_hand(d, 4 * d) + 2 * d
    d = 768  # Whisper small's encoder: two width-3 convolutions from 80 mel bins, 12 blocks, final LayerNorm
    convs = 3 * 80 * d + d + 3 * d * d + d
    assert audio_params(one.audio) == convs + 12 * encoder_block_by_hand(d, 4 * d) + 2 * d
    d = 2048  # both projectors map an encoder's width into the LLM's through one hidden layer of its width
    assert omni_params(one)["projectors"] == (1024 * d + d + d * d + d) + (768 * d + d + d * d + d)
    assert 1.6e9 < omni_params(one)["total"] < 1.7e9 and 0.29e9 < vision_params(one.vision) < 0.31e9
    assert 9.0e9 < omni_params(eight)["total"] < 9.1e9


def test_gpu_flavor_train_flops_by_hand() -> None:
    """omni-1b at the GPU check's shapes: one 8,192-token text document; then the same document holding one
    224 x 224 image (16 x 16 patches of 14, one placeholder each) among its tokens."""
    args = get_flavor("omni-1b", patch_size=14, n_mels=80)
    d, kv, f, v, n = 2048, 1024, 5632, 32000, 8192
    llm = 2 * n * (24 * (2 * d * d + 2 * d * kv + 3 * d * f) + d * v) + 24 * 4 * d * (n * (n + 1) // 2)
    assert omni_train_flops(args, [n]) == 3 * llm
    p, e = 16 * 16, 1024  # patches of the image, ViT width (MLP 4 x e)
    vit = 2 * p * 588 * e + 24 * (2 * p * (4 * e * e + 2 * e * 4 * e) + 4 * e * p * p)
    projector = 2 * p * (e * d + d * d)
    assert omni_train_flops(args, [n], image_grids=[(16, 16)]) == 3 * (llm + vit + projector)


def test_llm_flops_by_hand() -> None:
    args = LLMArgs(vocab_size=10, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=16)
    # matmul weights a token goes through: q, o 8x8 each; k, v 8x4 each; SwiGLU 3 x 8x16; head 8x10
    per_token = 2 * (2 * 64 + 2 * 32 + 3 * 128 + 80)
    # causal pairs: 3 + 2 + 1 (document of 3) + 2 + 1 (of 2) = 9; QK^T and AV: 2 x 2 FLOPs x 8 (heads x head_dim)
    assert attention_pairs([3, 2], causal=True) == 9 and attention_pairs([3, 2], causal=False) == 13
    assert llm_forward_flops(args, [3, 2]) == 5 * per_token + 4 * 8 * 9
    assert llm_flops_per_token(args, [3, 2]) == 3 * (5 * per_token + 4 * 8 * 9) / 5
    # The quadratic term follows the documents, not the packed length: one document of 5 costs more.
    assert llm_forward_flops(args, [5]) - llm_forward_flops(args, [3, 2]) == 4 * 8 * (15 - 9)
    moe = LLMArgs(
        vocab_size=10,
        dim=8,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        ffn_hidden=16,
        moe=MoEArgs(num_experts=4, top_k=2, shared_expert=True),
    )
    # router 8x4, and 2 routed + 1 shared SwiGLU experts per token
    assert llm_forward_flops(moe, [5]) - llm_forward_flops(args, [5]) == 2 * 5 * (32 + 2 * 3 * 128)


@pytest.mark.parametrize("flavor", ["debug", "debug-moe"])
def test_train_flops_match_torch_flop_counter(flavor: str) -> None:
    """torch counts every matmul and convolution of the real forward, attention included when SDPA takes its
    math path (two bmm per document; its fused CPU kernel, which the model gets, is not counted), but that
    path also computes the masked half of each causal document: our count, over the batch's own documents,
    images, clips and videos, is the counter's minus that half."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args = get_flavor(flavor, patch_size=PATCH_SIZE, n_mels=N_MELS)
    model = OmniModel(args)
    batch = make_batch(MIXED_DOCS + VIDEO_DOCS)  # every modality: no encoder runs a dummy input
    # torch's counter has no formula for the MoE's grouped GEMM: rows x in x out multiply-adds, as a matmul's
    counted = {torch.ops.aten._grouped_mm: lambda rows, weights, *_, **__: 2 * rows[0] * rows[1] * weights[-1]}
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, custom_mapping=counted) as counter:
        model(batch)
    docs = batch.cu_seqlens.diff().tolist()
    masked_half = attention_pairs(docs, causal=False) - attention_pairs(docs, causal=True)
    computed_but_masked = args.llm.n_layers * 4 * args.llm.dim * masked_half
    assert model.train_flops(batch) == 3 * (counter.get_total_flops() - computed_but_masked)
