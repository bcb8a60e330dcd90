"""The layers the transformer workloads are made of: a pre-norm attention + MLP block (dense or MoE), the
token embedding, the LM head, a ViT and a projector, each as a `Layer` with its per-sample costs.

The LLM, MLLM and trace builders (`lm_workloads`, `omni_workloads`, `paper_workloads`) share them, so that a
block is priced the same way wherever it appears. Host costs are the runtime's own aten operator counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omni_core.estimator.workloads import Layer

if TYPE_CHECKING:
    from omni_core.models.args import LLMArgs

# Aten operators (forward + backward) of the runtime's eager modules, counted once with a TorchDispatchMode
# around forward and backward of each module of the debug flavors (omni_core.models): fixed per micro-batch,
# plus per document (varlen attention), per image / clip, per routed expert.
ATTENTION_CALL_OPS = 51  # one document's attention (`varlen_attention`), forward + backward
BLOCK_OPS = 184  # a Llama block (RMSNorm, GQA + RoPE, SwiGLU), attention aside
ENCODER_BLOCK_OPS = 104  # a ViT / Whisper block (LayerNorm, MHA, GELU MLP), attention aside
MOE_OPS, EXPERT_OPS, SHARED_EXPERT_OPS = 187, 53, 33  # router + dispatch, each routed expert, the shared one
EMBED_OPS, HEAD_OPS, LOSS_OPS = 20, 38, 30  # embedding + RoPE tables, final norm + output, cross-entropy
PROJECTOR_OPS = 30
PATCH_EMBED_OPS, IMAGE_OPS = 22, 30  # patch embedding + final norm; per image: positions, merge, anchor
CONV_OPS, CLIP_OPS = 23, 22  # conv subsampling + final norm; per clip
BLOCK_TP_MODULES, MOE_TP_MODULES = 11, 8  # norms, attention input, q/k/v/o, FFN input, w1/w3/w2 (or the MoE)


def selective_matmuls(outputs: list[tuple[float, float]]) -> tuple[float, float]:
    """(elements kept, FLOPs recomputed) per token under op-level selective checkpointing, of a block's
    matmuls given as (output elements, weight elements) per token in forward order: torchtitan's policy keeps
    the attention kernel's output and every other matmul's (the 1st, 3rd, ...), and recomputes the rest with
    the element-wise operators between them."""
    kept = sum(out for out, _ in outputs[0::2])
    recomputed = sum(2 * weights for _, weights in outputs[1::2])
    return kept, recomputed


@dataclass(frozen=True)
class BlockArch:
    """A pre-norm attention + MLP block's architecture, and what follows from it alone (per token, whatever
    the sample's documents). MoE: `experts` routed FFNs, `top_k` of them per token, plus an optional shared
    FFN every token goes through; `expert_group` > 0: GShard's dense dispatch over groups of that many tokens
    (`transformer_block`)."""

    dim: int
    heads: int
    kv_heads: int
    ffn: int
    gated: bool
    bias: bool
    experts: int = 0
    top_k: int = 1
    shared_expert: bool = False
    expert_group: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def mats(self) -> int:
        """Matrices of one FFN: w1, w2 (and the gate's w3)."""
        return 3 if self.gated else 2

    @property
    def attn_params(self) -> int:
        return self.dim * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.dim

    @property
    def ffn_params(self) -> int:
        """Of one FFN."""
        return self.mats * self.dim * self.ffn

    @property
    def routes(self) -> int:
        """FFNs each token goes through."""
        return (self.top_k if self.experts else 1) + self.shared_expert

    @property
    def ffns(self) -> int:
        """FFNs the block holds."""
        return max(self.experts, 1) + self.shared_expert

    @property
    def router(self) -> int:
        return self.dim * self.experts

    @property
    def params(self) -> int:
        """Every parameter: matmul weights, biases, norms and the router."""
        dim, ffn, mats = self.dim, self.ffn, self.mats
        bias_params = (dim * 3 + dim + ffn * (mats - 1) + dim) if self.bias else 0
        norm_params = 2 * dim * (2 if self.bias else 1)
        return self.attn_params + self.ffn_params * self.ffns + bias_params + norm_params + self.router

    @property
    def ops(self) -> int:
        """The block's aten operators per micro-batch, attention calls aside."""
        if self.experts:
            return MOE_OPS + EXPERT_OPS * self.experts + SHARED_EXPERT_OPS * self.shared_expert
        return BLOCK_OPS if self.gated else ENCODER_BLOCK_OPS

    @property
    def tensors(self) -> int:
        """Parameter tensors: matrices, biases (no key bias), norms."""
        weights = 4 + self.mats * self.ffns + (1 if self.experts else 0)
        return weights + (weights - 1 if self.bias else 0) + (4 if self.bias else 2)

    @property
    def io_per_token(self) -> int:
        """Matmul operands per token: q/k/v/o in and out, each FFN matrix's in and out (x routes), the router."""
        dim, head_dim = self.dim, self.head_dim
        return (
            4 * dim
            + 2 * (self.heads + self.kv_heads) * head_dim
            + self.routes * self.mats * (dim + self.ffn)
            + (dim + self.experts)
        )

    @property
    def dispatch(self) -> float:
        """FLOPs per token of GShard's einsum dispatch + combine."""
        return 2 * 2 * self.top_k * self.expert_group * self.dim if self.experts else 0.0

    @property
    def masks(self) -> float:
        """The dispatch and combine masks' elements per token."""
        return 2 * self.top_k * self.expert_group if self.experts else 0.0

    def selective(self) -> tuple[float, float]:
        """(elements kept, FLOPs recomputed) per token under selective checkpointing (`selective_matmuls`)."""
        dim, ffn = self.dim, self.ffn
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        ffn_mats = [(ffn, dim * ffn)] * (self.mats - 1) + [(dim, dim * ffn)]  # w1 (and w3), then w2
        return selective_matmuls([(q, dim * q), (kv, dim * kv), (kv, dim * kv), (dim, q * dim), *ffn_mats])


def transformer_block(
    name: str,
    *,
    dim: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    tokens: float,
    sum_sq: float,
    docs: float,
    causal: bool,
    gated: bool,
    bias: bool,
    dtype_bytes: int = 2,
    experts: int = 0,
    top_k: int = 1,
    shared_expert: bool = False,
    expert_group: int = 0,
) -> Layer:
    """A pre-norm attention + MLP block over `tokens` per sample, `docs` documents whose squared lengths
    sum to `sum_sq`. MoE: `experts` routed FFNs, `top_k` of them per token (GShard: 2), plus an optional
    shared FFN every token goes through. `expert_group` > 0: GShard's dense dispatch (Alpa's MoE layer), which
    routes groups of that many tokens by einsums with one-hot [group, experts, capacity] masks at capacity
    top_k x group / experts: dispatch and combine each cost 2 x top_k x group x dim FLOPs per token, and the
    masks' elements are activations (0: index-based routing, the runtime's, whose cost is its operators)."""
    arch = BlockArch(dim, heads, kv_heads, ffn, gated, bias, experts, top_k, shared_expert, expert_group)
    return block_layer(name, arch, tokens=tokens, sum_sq=sum_sq, docs=docs, causal=causal, dtype_bytes=dtype_bytes)


def block_layer(
    name: str, arch: BlockArch, *, tokens: float, sum_sq: float, docs: float, causal: bool, dtype_bytes: int
) -> Layer:
    """`arch` as a `Layer` over `tokens` per sample in `docs` documents whose squared lengths sum to `sum_sq`
    (`transformer_block`)."""
    dim, heads, kv_heads, head_dim, ffn = arch.dim, arch.heads, arch.kv_heads, arch.head_dim, arch.ffn
    mats, experts, routes, ffn_params, router = arch.mats, arch.experts, arch.routes, arch.ffn_params, arch.router
    attn_pairs = sum_sq * (0.5 if causal else 1.0)
    b = dtype_bytes
    q = heads * head_dim
    sac_kept, sac_recomputed = arch.selective()
    masks = arch.masks
    return Layer(
        name=name,
        params=arch.params,
        flops=2 * tokens * (arch.attn_params + ffn_params * routes + router) + tokens * arch.dispatch,
        attn_flops=4 * head_dim * heads * attn_pairs,
        attn_scores=heads * sum_sq,
        causal=causal,
        mm_bytes=b * tokens * arch.io_per_token,
        mm_weight_bytes=b * (arch.attn_params + ffn_params * arch.ffns + router),
        # Korthikanti et al. 2022 (flash attention: no s^2 term): inputs of each matmul, norm and activation
        act_bytes=b * tokens * (8 * dim + 2 * kv_heads * head_dim + (mats + 1) * ffn * routes + masks),
        out_bytes=b * tokens * dim,
        sac_bytes=0.0 if experts else b * tokens * (sac_kept + q),  # the matmuls' and attention's outputs
        sac_flops=0.0 if experts else tokens * sac_recomputed,  # (not modelled for MoE: `terms.recompute_share`)
        mem_bytes=b * tokens * (14 * dim + (mats + 1) * ffn * routes + 2 * masks),
        tp_bytes=4 * b * tokens * dim,  # sequence parallel: an all-gather and a reduce-scatter of the whole
        # activation around attention, and again around the FFN
        a2a_bytes=b * tokens * dim * arch.top_k if experts else 0.0,
        expert_params=ffn_params * experts,
        ops=arch.ops,
        attn_calls=docs,
        tensors=arch.tensors,
        units=1.0,
        tp_colls=4.0,
        tp_modules=MOE_TP_MODULES if experts else BLOCK_TP_MODULES,
        expert_ops=EXPERT_OPS * experts,
        expert_tensors=mats * experts,
        expert_flops=2 * tokens * (ffn_params * routes + router) + tokens * arch.dispatch if experts else 0.0,
    )


def embedding(name: str, vocab: int, dim: int, tokens: float, dtype_bytes: int = 2) -> Layer:
    return Layer(
        name,
        params=vocab * dim,
        flops=0.0,
        out_bytes=dtype_bytes * tokens * dim,
        mem_bytes=2 * dtype_bytes * tokens * dim,
        ops=EMBED_OPS,
        tensors=1,
        tp_modules=1,
    )


def lm_head(name: str, vocab: int, dim: int, tokens: float, tied: bool = False, dtype_bytes: int = 2) -> Layer:
    """Final norm + vocabulary projection + cross-entropy; the fp32 logits dominate its activations. Under TP
    the projection is split over the vocabulary: tokens are gathered before it and logits after it."""
    return Layer(
        name,
        params=0 if tied else vocab * dim,
        flops=2 * tokens * vocab * dim,
        mm_bytes=dtype_bytes * tokens * (dim + vocab),
        mm_weight_bytes=dtype_bytes * vocab * dim,
        act_bytes=tokens * (dtype_bytes * dim + 4 * vocab),
        out_bytes=0.0,
        mem_bytes=tokens * (3 * 4 * vocab + 4 * dtype_bytes * dim),
        tp_bytes=dtype_bytes * tokens * (dim + vocab),
        ops=HEAD_OPS + LOSS_OPS,
        tensors=1 if tied else 2,
        tp_colls=2.0,
        tp_modules=2,
    )


def vit(
    name: str,
    *,
    n_layers: int,
    dim: int,
    heads: int,
    patches: float,
    sum_sq: float,
    images: float,
    patch_dim: int,
    mlp_ratio: float = 4.0,
    dtype_bytes: int = 2,
) -> tuple[Layer, ...]:
    """A ViT over `patches` per sample in `images` documents (bidirectional attention per image)."""
    block = transformer_block(
        f"{name}.block",
        dim=dim,
        heads=heads,
        kv_heads=heads,
        ffn=int(dim * mlp_ratio),
        tokens=patches,
        sum_sq=sum_sq,
        docs=images,
        causal=False,
        gated=False,
        bias=True,
        dtype_bytes=dtype_bytes,
    )
    b = dtype_bytes
    # with the positions (two factorized tables) and the final norm: the encoder's own FSDP unit
    embed = Layer(
        f"{name}.patch_embed",
        params=patch_dim * dim + 3 * dim,
        flops=2 * patches * patch_dim * dim,
        mm_bytes=b * patches * (patch_dim + dim),
        mm_weight_bytes=b * patch_dim * dim,
        act_bytes=b * patches * patch_dim,
        out_bytes=b * patches * dim,
        mem_bytes=4 * b * patches * dim,
        ops=PATCH_EMBED_OPS,
        sample_ops=IMAGE_OPS * images,
        tensors=6,
        units=1,
    )
    return (embed, *([block] * n_layers))


def projector(name: str, in_dim: int, hidden: int, out_dim: int, tokens: float, dtype_bytes: int = 2) -> Layer:
    """A two-layer GELU MLP in_dim -> hidden -> out_dim over `tokens`; hidden 0: one Linear in_dim -> out_dim
    (`models.flops.projector_dims`, Qwen2-Audio's projector)."""
    if hidden == 0:
        return _linear_projector(name, in_dim, out_dim, tokens, dtype_bytes)
    params = in_dim * hidden + hidden + hidden * out_dim + out_dim
    b = dtype_bytes
    return Layer(
        name,
        params=params,
        flops=2 * tokens * (in_dim * hidden + hidden * out_dim),
        mm_bytes=b * tokens * (in_dim + 2 * hidden + out_dim),
        mm_weight_bytes=b * (params - hidden - out_dim),
        act_bytes=b * tokens * (in_dim + 2 * hidden),
        out_bytes=b * tokens * out_dim,
        mem_bytes=b * tokens * (3 * hidden + 2 * out_dim),
        tp_bytes=b * tokens * out_dim,
        ops=PROJECTOR_OPS,
        tensors=4,
        units=1,
    )


def _linear_projector(name: str, in_dim: int, out_dim: int, tokens: float, b: int) -> Layer:
    """One Linear with its bias: its input read, its output written, no activation kept but its input."""
    params = in_dim * out_dim + out_dim
    return Layer(
        name,
        params=params,
        flops=2 * tokens * in_dim * out_dim,
        mm_bytes=b * tokens * (in_dim + out_dim),
        mm_weight_bytes=b * in_dim * out_dim,
        act_bytes=b * tokens * in_dim,
        out_bytes=b * tokens * out_dim,
        mem_bytes=b * tokens * 2 * out_dim,
        tp_bytes=b * tokens * out_dim,
        ops=PROJECTOR_OPS,
        tensors=2,
        units=1,
    )


def llm_layers(llm: LLMArgs, seq_len: int, sum_sq: float, docs: float, dtype_bytes: int = 2) -> tuple[Layer, ...]:
    """The LLM's embedding, its blocks (dense or MoE, causal over the sequence's `docs` documents whose squared
    lengths sum to `sum_sq`) and its head."""
    moe = llm.moe
    block = transformer_block(
        "llm.block",
        dim=llm.dim,
        heads=llm.n_heads,
        kv_heads=llm.n_kv_heads,
        ffn=llm.ffn_hidden,
        tokens=seq_len,
        sum_sq=sum_sq,
        docs=docs,
        causal=True,
        gated=True,
        bias=False,
        dtype_bytes=dtype_bytes,
        experts=moe.num_experts if moe else 0,
        top_k=moe.top_k if moe else 1,
        shared_expert=bool(moe and moe.shared_expert),
    )
    return (
        embedding("llm.embed", llm.vocab_size, llm.dim, seq_len, dtype_bytes),
        *([block] * llm.n_layers),
        lm_head("llm.head", llm.vocab_size, llm.dim, seq_len, dtype_bytes=dtype_bytes),
    )
