"""Parameter and FLOP counts from architecture args alone (no module is built), so the estimator can price
175B-scale flavors and the trainer can compute MFU from a batch's actual documents.

Conventions (Kaplan et al. / PaLM): a multiply-add is 2 FLOPs; only matmuls and convolutions count
(norms, activations, softmax, biases and the embedding lookup are not FLOPs here); backward costs twice the
forward, so training is TRAIN_FACTOR = 3 x forward. Attention's scores and context (QK^T and AV) cost
4 * head_dim * n_heads FLOPs per attended (query, key) pair: L^2 pairs for a bidirectional document and
L (L + 1) / 2 for a causal one, summed over the actual documents, never over the packed length.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from omni_core.common.batch import audio_tokens, video_tokens
from omni_core.models.args import AudioArgs, LLMArgs, OmniModelArgs, VisionArgs

TRAIN_FACTOR = 3


def merged_grid(rows: int, cols: int, merge: int) -> tuple[int, int]:
    """Token grid of one image after the projector's `spatial_merge` (a partial window at the edge still makes
    a token)."""
    return -(-rows // merge), -(-cols // merge)


def attention_pairs(doc_lengths: Iterable[int], causal: bool) -> int:
    """(query, key) pairs attention computes over these documents."""
    return sum(n * (n + 1) // 2 if causal else n * n for n in doc_lengths)


# --- parameters ------------------------------------------------------------------------------------------


def linear_params(d_in: int, d_out: int, bias: bool = True) -> int:
    return d_in * d_out + (d_out if bias else 0)


def encoder_block_params(dim: int, mlp_ratio: float) -> int:
    """LayerNorm x2, attention (q, v, o biases; no k bias), GELU MLP with biases."""
    hidden = int(dim * mlp_ratio)
    attention = 3 * linear_params(dim, dim) + linear_params(dim, dim, bias=False)
    return 2 * 2 * dim + attention + linear_params(dim, hidden) + linear_params(hidden, dim)


def llm_block_matmul_params(args: LLMArgs, active: bool) -> int:
    """Weights of one block's matmuls; `active`: only those a token goes through (k experts of E)."""
    head_dim = args.dim // args.n_heads
    attention = 2 * args.dim * args.n_heads * head_dim + 2 * args.dim * args.n_kv_heads * head_dim
    expert = 3 * args.dim * args.ffn_hidden
    moe = args.moe
    if moe is None:
        return attention + expert
    routed = moe.top_k if active else moe.num_experts
    shared = (
        3 * args.dim * (moe.shared_hidden or args.ffn_hidden) + args.dim * moe.shared_gate if moe.shared_expert else 0
    )
    return attention + args.dim * moe.num_experts + routed * expert + shared


def llm_params(args: LLMArgs) -> int:
    head_dim = args.dim // args.n_heads
    qkv_bias = (args.n_heads + 2 * args.n_kv_heads) * head_dim if args.qkv_bias else 0
    block = llm_block_matmul_params(args, active=False) + qkv_bias + 2 * args.dim
    embeddings = (1 if args.tied_embeddings else 2) * args.vocab_size * args.dim
    return embeddings + args.n_layers * block + args.dim


def vision_params(args: VisionArgs) -> int:
    positions = (2 * args.max_grid if args.pos_embed == "factorized" else args.max_grid**2) * args.dim
    blocks = args.n_layers * encoder_block_params(args.dim, args.mlp_ratio)
    return linear_params(args.patch_dim, args.dim) + positions + blocks + 2 * args.dim


def audio_params(args: AudioArgs) -> int:
    convs = 3 * args.n_mels * args.dim + args.dim + 3 * args.dim * args.dim + args.dim
    return convs + args.n_layers * encoder_block_params(args.dim, args.mlp_ratio) + 2 * args.dim


def projector_params(d_in: int, hidden: int, d_out: int) -> int:
    """Hidden 0: one Linear d_in -> d_out (`projector_dims`)."""
    if hidden == 0:
        return linear_params(d_in, d_out)
    return linear_params(d_in, hidden) + linear_params(hidden, d_out)


def projector_dims(args: OmniModelArgs) -> dict[str, tuple[int, int, int]]:
    """(in, hidden, out) of each projector; the image one sees spatial_merge^2 concatenated patches. Hidden 0:
    one Linear, no hidden layer (the audio projector under `audio_projector: linear`, Qwen2-Audio's)."""
    hidden = args.projector_mult * args.llm.dim
    return {
        "image": (args.vision.dim * args.spatial_merge**2, hidden, args.llm.dim),
        "audio": (args.audio.dim, 0 if args.audio_projector == "linear" else hidden, args.llm.dim),
    }


def omni_params(args: OmniModelArgs) -> dict[str, int]:
    """Parameters per part (the OmniModel's submodule names) and their `total`."""
    counts = {
        "vision": vision_params(args.vision),
        "audio": audio_params(args.audio),
        "projectors": sum(projector_params(*dims) for dims in projector_dims(args).values()),
        "llm": llm_params(args.llm),
    }
    return {**counts, "total": sum(counts.values())}


# --- forward FLOPs ---------------------------------------------------------------------------------------


def llm_forward_flops(args: LLMArgs, doc_lengths: Sequence[int]) -> float:
    """One forward over packed causal documents of these lengths, including the output head."""
    tokens = sum(doc_lengths)
    matmuls = args.n_layers * llm_block_matmul_params(args, active=True) + args.dim * args.vocab_size
    attention = args.n_layers * 4 * args.dim * attention_pairs(doc_lengths, causal=True)
    return 2.0 * tokens * matmuls + attention


def llm_flops_per_token(args: LLMArgs, doc_lengths: Sequence[int]) -> float:
    """Training (forward + backward) FLOPs per token of a sequence made of these documents."""
    return TRAIN_FACTOR * llm_forward_flops(args, doc_lengths) / sum(doc_lengths)


def encoder_blocks_flops(dim: int, n_layers: int, mlp_ratio: float, tokens: int) -> float:
    """Bidirectional encoder blocks over one document of `tokens`."""
    matmuls = 4 * dim * dim + 2 * dim * int(dim * mlp_ratio)
    return n_layers * (2.0 * tokens * matmuls + 4 * dim * tokens * tokens)


def vision_forward_flops(args: VisionArgs, patches: int) -> float:
    """One image of `patches` patches (one attention document)."""
    embed = 2.0 * patches * args.patch_dim * args.dim
    return embed + encoder_blocks_flops(args.dim, args.n_layers, args.mlp_ratio, patches)


def audio_forward_flops(args: AudioArgs, frames: int) -> float:
    """One clip of `frames` log-mel frames: conv1 (stride 1), conv2 (stride 2), blocks over frames // 2."""
    tokens = frames // 2
    convs = 2.0 * 3 * (frames * args.n_mels * args.dim + tokens * args.dim * args.dim)
    return convs + encoder_blocks_flops(args.dim, args.n_layers, args.mlp_ratio, tokens)


def projector_forward_flops(d_in: int, hidden: int, d_out: int, tokens: int) -> float:
    if hidden == 0:  # one Linear (`projector_dims`)
        return 2.0 * tokens * d_in * d_out
    return 2.0 * tokens * (d_in * hidden + hidden * d_out)


def omni_train_flops(
    args: OmniModelArgs,
    doc_lengths: Sequence[int],
    image_grids: Sequence[tuple[int, int]] = (),
    audio_frames: Sequence[int] = (),
    video_grids: Sequence[tuple[int, int, int]] = (),
) -> float:
    """Forward + backward FLOPs of one packed batch: LLM documents, images by (rows, cols), clips by frames,
    videos by (frames, rows, cols): every frame through the ViT, the image projector after the temporal merge
    (its averaging is no matmul). Frozen parts are counted as trained (the MFU convention: 3x forward for
    every FLOP of the model)."""
    dims = projector_dims(args)
    flops = llm_forward_flops(args.llm, doc_lengths)
    for rows, cols in image_grids:
        m_rows, m_cols = merged_grid(rows, cols, args.spatial_merge)
        flops += vision_forward_flops(args.vision, rows * cols)
        flops += projector_forward_flops(*dims["image"], m_rows * m_cols)
    for frames in audio_frames:
        pooled = audio_tokens(frames, args.audio.pool)
        flops += audio_forward_flops(args.audio, frames) + projector_forward_flops(*dims["audio"], pooled)
    for frames, rows, cols in video_grids:
        merged = video_tokens(frames, rows, cols, args.temporal_merge, args.spatial_merge)
        flops += frames * vision_forward_flops(args.vision, rows * cols)
        flops += projector_forward_flops(*dims["image"], merged)
    return TRAIN_FACTOR * flops
