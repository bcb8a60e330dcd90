"""What the cost model prices: a job as lists of `Layer`s with per-sample costs, built from a shape.

A `Workload` is the LLM part (split into pipeline stages) and, for MLLMs, the encoder part (ViT, audio
encoder and projectors, placed by the layout). Every per-layer number is per *sample* (one packed sequence
for LLMs, one image for CNNs) so that a plan's micro-batch cost is a multiplication, and prefix sums over
layers make any stage's cost O(1): that is what keeps plan evaluation fast.

Builders: `transformer` (dense GPT/Llama and GShard-style MoE), `wide_resnet` (Alpa's Wide-ResNet),
`omni_workload` (an `OmniModelArgs` flavor, with document lengths from a `DatasetProfile`), `trace_workload`
(Crius trace names such as `bert__1.3B`, `moe__10B`, `wide_resnet__2B`) and `paper_workload` (MegaScale-Omni's
A-D at an image:text mix).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace
from functools import cache
from typing import TYPE_CHECKING

from omni_core.common.plan import ModelShape

if TYPE_CHECKING:
    from omni_core.data.profile import DatasetProfile
    from omni_core.models.args import OmniModelArgs

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4}  # tf32: fp32 tensors, matmuls on TF32 tensor cores
# Optimizer states per parameter (fp32), beside the weights, their gradients and (for 2-byte weights) an fp32
# master copy; and the bytes its update streams per parameter relative to AdamW's (`Efficiency.
# optimizer_bytes_per_param` is AdamW's): AdamW reads p, g, m, v and writes p, m, v; SGD with momentum reads
# p, g, m and writes p, m; Adafactor (optax's default: no momentum, factored second moments of rows and
# columns) reads p, g and writes p.
OPTIMIZERS = {"adamw": (8.0, 1.0), "sgd": (4.0, 5 / 7), "adafactor": (0.0, 3 / 7)}


@dataclass(frozen=True)
class Layer:
    """One layer's costs per sample (forward). Backward is priced as 2x forward FLOPs by the cost model.

    Host costs are counted as the runtime's eager PyTorch runs them: `ops` aten operators per micro-batch and
    `sample_ops` per sample, forward + backward together (counted once from the model code with a dispatch
    counter, see the builders), and `attn_calls` attention calls per sample, one per packed document."""

    name: str
    params: float
    flops: float  # weight matmul / conv FLOPs
    attn_flops: float = 0.0  # attention scores and context (QK^T, AV): no weights, quadratic in document length
    attn_scores: float = 0.0  # elements of the full score matrices (heads x sum of squared document lengths)
    causal: bool = False  # causal attention: attn_flops count the visible half, a flash kernel skips the rest
    mm_bytes: float = 0.0  # matmul inputs and outputs: small matmuls are bound by their operands, not FLOPs
    mm_weight_bytes: float = 0.0  # matmul weights, read once per micro-batch
    act_bytes: float = 0.0  # activations kept for backward without checkpointing
    out_bytes: float = 0.0  # the output: what checkpointing keeps and what a pipeline stage sends on
    # op-level selective checkpointing (`selective_matmuls`): what it keeps beyond the output, and the FLOPs of
    # the matmuls it recomputes
    sac_bytes: float = 0.0
    sac_flops: float = 0.0
    mem_bytes: float = 0.0  # memory-bound traffic (norms, activation functions, residuals, softmax)
    # the buffers of TP's collectives per forward (each all-gather's output, each reduce-scatter's input);
    # backward mirrors every one of them (an all-gather's gradient is a reduce-scatter, and back)
    tp_bytes: float = 0.0
    a2a_bytes: float = 0.0  # bytes dispatched to experts per forward all-to-all (dispatch + combine = 2)
    expert_params: float = 0.0  # of `params`, those sharded by expert parallelism
    ops: float = 0.0  # aten operators per micro-batch, forward + backward (launch or dispatch overhead)
    sample_ops: float = 0.0  # the same per sample (per image, per clip)
    attn_calls: float = 0.0  # attention calls per sample (one per packed document on the CPU runtime)
    tensors: float = 0.0  # parameter tensors (the optimizer and the gradient norm pay per tensor)
    units: float = 0.0  # FSDP units it forms (a block; an encoder's remaining modules); the rest is the root's
    tp_colls: float = 0.0  # TP collectives per forward, each mirrored in backward
    tp_modules: float = 0.0  # modules TP parallelizes (each redistributes DTensors in forward and backward)
    expert_ops: float = 0.0  # of `ops`, those of the routed experts' loop (a rank runs E / ep experts)
    expert_tensors: float = 0.0  # of `tensors`, the routed experts' (sharded by EP)
    expert_flops: float = 0.0  # of `flops`, the router's and the experts' (the runtime does not split them by TP)


@dataclass(frozen=True)
class EncoderItems:
    """The encoder items (images, clips) as the `omni` layout balances and splits them, described by the
    encoder whose longest item is the longest (`encoder`: its `EncoderSpec` lays that item out).

    An item of x times `tokens` (the mean length, in the tokens an LSSP threshold counts: patches, mel frames)
    costs `work` x ((1 - quad) x + quad x^2) mean samples of encoder work: linear layers and attention's
    quadratic share (`encoders.item_length` inverts it)."""

    encoder: str = "vision"  # "vision" or "audio": a key of `EncoderPlan`
    count: float = 0.0  # that encoder's items per sample
    tokens: float = 0.0  # their mean length
    heads: int = 1  # that encoder's attention heads (an LSSP group splits them)
    quad: float = 0.0  # attention's share of the encoders' work at the mean length
    work: float = 0.0  # a mean item's encoder work, in mean samples'
    input_bytes: float = 0.0  # raw inputs per sample (fp32 patches, mel frames): what the data shard ships


@dataclass(frozen=True)
class Workload:
    name: str
    llm: tuple[Layer, ...]  # pipelined part
    global_batch: int  # samples per step
    shape: ModelShape  # what the plan must divide (`ParallelPlan.check_model`)
    encoder: tuple[Layer, ...] = ()  # MLLM encoders + projectors (placed by the layout)
    precision: str = "bf16"
    tokens_per_sample: float = 1.0  # LLM tokens per sample (for tokens/s and the PP message)
    encoder_cv: float = 0.0  # coefficient of variation of the encoder work per sample (load imbalance)
    loader_imbalance: float = 0.0  # 0: batches packed by tokens alone; else the max / mean per-rank work the
    # loaders' balancing leaves (data.balance: the profile's simulated figure under the recipe's policy)
    encoder_max_item: float = 0.0  # encoder work of the longest single item (image, clip), in mean samples' work
    items: EncoderItems = EncoderItems()
    head_dim: int = 0  # the LLM's (ring attention's tiles)
    doc_span: float = 0.0  # E[L^2] / E[L] of the LLM's documents: the length of the one a random token is in
    optimizer: str = "adamw"  # a key of OPTIMIZERS: its states are part of the job's memory and its step
    recompute: bool | None = None  # activation recomputation the job fixes (True / False); None: searched
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # stage partitions and sums by pp

    @property
    def cost_prefix(self) -> tuple[float, ...]:
        """Running FLOPs (weights + attention) over the LLM layers: what the stage partition balances."""
        prefix = self.cache.get("cost_prefix")
        if prefix is None:
            prefix = self.cache["cost_prefix"] = tuple(
                itertools.accumulate((layer.flops + layer.attn_flops for layer in self.llm), initial=0.0)
            )
        return prefix

    @property
    def params(self) -> float:
        return sum(layer.params for layer in self.llm + self.encoder)

    @property
    def is_moe(self) -> bool:
        return self.shape.num_experts > 0


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


# --- transformers --------------------------------------------------------------------------------------


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
    head_dim = dim // heads
    attn_params = dim * (heads + 2 * kv_heads) * head_dim + heads * head_dim * dim
    mats = 3 if gated else 2
    ffn_params = mats * dim * ffn
    bias_params = (dim * 3 + dim + ffn * (mats - 1) + dim) if bias else 0
    norm_params = 2 * dim * (2 if bias else 1)
    routes = (top_k if experts else 1) + shared_expert  # FFNs each token goes through
    router = dim * experts
    attn_pairs = sum_sq * (0.5 if causal else 1.0)
    b = dtype_bytes
    ffns = max(experts, 1) + shared_expert
    weights = 4 + mats * ffns + (1 if experts else 0)
    if experts:
        ops = MOE_OPS + EXPERT_OPS * experts + SHARED_EXPERT_OPS * shared_expert
    else:
        ops = BLOCK_OPS if gated else ENCODER_BLOCK_OPS
    # matmul operands per token: q/k/v/o in and out, each FFN matrix's in and out (x routes), the router
    io_per_token = 4 * dim + 2 * (heads + kv_heads) * head_dim + routes * mats * (dim + ffn) + (dim + experts)
    dispatch = 2 * 2 * top_k * expert_group * dim if experts else 0.0  # einsum dispatch + combine, per token
    q, kv = heads * head_dim, kv_heads * head_dim
    ffn_mats = [(ffn, dim * ffn)] * (mats - 1) + [(dim, dim * ffn)]  # w1 (and w3), then w2
    sac_kept, sac_recomputed = selective_matmuls(
        [(q, dim * q), (kv, dim * kv), (kv, dim * kv), (dim, q * dim), *ffn_mats]
    )
    masks = 2 * top_k * expert_group if experts else 0.0  # the dispatch and combine masks' elements per token
    return Layer(
        name=name,
        params=attn_params + ffn_params * ffns + bias_params + norm_params + router,
        flops=2 * tokens * (attn_params + ffn_params * routes + router) + tokens * dispatch,
        attn_flops=4 * head_dim * heads * attn_pairs,
        attn_scores=heads * sum_sq,
        causal=causal,
        mm_bytes=b * tokens * io_per_token,
        mm_weight_bytes=b * (attn_params + ffn_params * ffns + router),
        # Korthikanti et al. 2022 (flash attention: no s^2 term): inputs of each matmul, norm and activation
        act_bytes=b * tokens * (8 * dim + 2 * kv_heads * head_dim + (mats + 1) * ffn * routes + masks),
        out_bytes=b * tokens * dim,
        sac_bytes=0.0 if experts else b * tokens * (sac_kept + q),  # the matmuls' and attention's outputs
        sac_flops=0.0 if experts else tokens * sac_recomputed,  # (not modelled for MoE: `terms.recompute_share`)
        mem_bytes=b * tokens * (14 * dim + (mats + 1) * ffn * routes + 2 * masks),
        tp_bytes=4 * b * tokens * dim,  # sequence parallel: an all-gather and a reduce-scatter of the whole
        # activation around attention, and again around the FFN
        a2a_bytes=b * tokens * dim * top_k if experts else 0.0,
        expert_params=ffn_params * experts,
        ops=ops,
        attn_calls=docs,
        tensors=weights + (weights - 1 if bias else 0) + (4 if bias else 2),  # matrices, biases (no key bias), norms
        units=1.0,
        tp_colls=4.0,
        tp_modules=MOE_TP_MODULES if experts else BLOCK_TP_MODULES,
        expert_ops=EXPERT_OPS * experts,
        expert_tensors=mats * experts,
        expert_flops=2 * tokens * (ffn_params * routes + router) + tokens * dispatch if experts else 0.0,
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


def transformer(
    name: str,
    *,
    n_layers: int,
    dim: int,
    heads: int,
    vocab: int,
    seq_len: int,
    global_batch: int,
    kv_heads: int | None = None,
    ffn: int | None = None,
    gated: bool = False,
    bias: bool = True,
    experts: int = 0,
    top_k: int = 2,
    doc_len: float | None = None,
    precision: str = "bf16",
    tied: bool = False,
    moe_every: int = 1,
    expert_group: int = 0,
    optimizer: str = "adamw",
    recompute: bool | None = None,
) -> Workload:
    """A decoder-only LM (GPT with `gated=False, bias=True`; Llama with `gated=True, bias=False`), dense or
    MoE (`experts` > 0: the FFN of every `moe_every`-th block, from the first, is a mixture; the Alpa/Crius
    `moe__*` models alternate, with GShard's einsum dispatch over `expert_group` tokens). Samples are
    sequences of `seq_len` tokens made of documents of `doc_len` (default: one document per sequence);
    `optimizer` and `recompute` as the job fixes them (`Workload`)."""
    kv_heads = kv_heads or heads
    ffn = ffn or 4 * dim
    doc_len = min(doc_len or seq_len, seq_len)
    docs = seq_len / doc_len
    b = BYTES[precision]
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"{name}: optimizer={optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    common = dict(
        dim=dim,
        heads=heads,
        kv_heads=kv_heads,
        ffn=ffn,
        tokens=seq_len,
        sum_sq=docs * doc_len**2,
        docs=docs,
        causal=True,
        gated=gated,
        bias=bias,
        dtype_bytes=b,
    )
    block = transformer_block("block", **common, experts=experts, top_k=top_k, expert_group=expert_group)
    dense = transformer_block("block", **common) if experts and moe_every > 1 else block
    blocks = [block if i % moe_every == 0 else dense for i in range(n_layers)]
    layers = (embedding("embed", vocab, dim, seq_len, b), *blocks, lm_head("head", vocab, dim, seq_len, tied, b))
    shape = ModelShape(n_layers=n_layers, n_heads=heads, n_kv_heads=kv_heads, num_experts=experts, seq_len=seq_len)
    return Workload(
        name,
        layers,
        global_batch,
        shape,
        precision=precision,
        tokens_per_sample=seq_len,
        head_dim=dim // heads,
        doc_span=doc_len,
        optimizer=optimizer,
        recompute=recompute,
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


# --- Wide-ResNet (Alpa benchmark suite) ------------------------------------------------------------------


def wide_resnet(
    name: str,
    *,
    depth: int,
    base_channels: int,
    width_factor: int,
    global_batch: int,
    image: int = 224,
    classes: int = 1024,
    precision: str = "fp32",
    optimizer: str = "sgd",
    recompute: bool | None = None,
) -> Workload:
    """Alpa's Wide-ResNet (alpa/model/wide_resnet.py): a 7x7 stem, bottleneck blocks with 1x1 (f),
    3x3 (f * width_factor), 1x1 (4f) convolutions and a projection on each stage's first block; f doubles
    per stage. One pipeline layer per residual block; the convolutions are data/pipeline parallel only."""
    stages = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}[depth]
    b = BYTES[precision]

    def conv(cin: int, cout: int, k: int, hw: int) -> tuple[float, float]:
        params = cin * cout * k * k
        return params, 2 * params * hw * hw  # params, forward FLOPs at output resolution hw x hw

    side = image // 2
    p, f = conv(3, base_channels, 7, side)
    side //= 2  # max-pool
    layers = [
        Layer(
            "stem",
            params=p + 2 * base_channels,
            flops=f,
            act_bytes=b * (3 * image**2 + 2 * base_channels * side**2 * 4),
            out_bytes=b * base_channels * side**2,
            mem_bytes=6 * b * base_channels * side**2 * 4,
            ops=4,
        )
    ]
    cin = base_channels
    for i, blocks in enumerate(stages):
        filters = base_channels * 2**i
        for j in range(blocks):
            out_side = side // 2 if (i > 0 and j == 0) else side
            parts = [
                conv(cin, filters, 1, side),
                conv(filters, filters * width_factor, 3, out_side),
                conv(filters * width_factor, 4 * filters, 1, out_side),
            ]
            if cin != 4 * filters or out_side != side:
                parts.append(conv(cin, 4 * filters, 1, out_side))
            acts = cin * side**2 + (filters + filters * width_factor + 4 * filters) * out_side**2
            layers.append(
                Layer(
                    f"stage{i}.block{j}",
                    params=sum(p for p, _ in parts) + 2 * (2 * filters + filters * width_factor + 4 * filters),
                    flops=sum(f for _, f in parts),
                    act_bytes=2 * b * acts,
                    out_bytes=b * 4 * filters * out_side**2,
                    mem_bytes=4 * b * acts,
                    ops=12,
                )
            )
            cin, side = 4 * filters, out_side
    layers.append(
        Layer(
            "head",
            params=cin * classes + classes,
            flops=2 * cin * classes,
            act_bytes=b * cin,
            mem_bytes=b * cin * side**2,
            ops=4,
        )
    )
    # n_heads=1: the plan object then refuses tp > 1 (convolutions are not tensor-parallel here)
    shape = ModelShape(n_layers=len(layers), n_heads=1, n_kv_heads=1)
    return Workload(
        name, tuple(layers), global_batch, shape, precision=precision, optimizer=optimizer, recompute=recompute
    )


# --- the Crius trace's models --------------------------------------------------------------------------

# Alpa benchmark suite shapes (README of shared/data): (hidden, layers, heads) and MoE (hidden, layers, experts).
# The jobs are Alpa's benchmark cases (alpa/benchmark/alpa): GPT in fp16 with AdamW; MoE in fp16 with
# Adafactor, 16 heads, FFN 8 x hidden, every other layer a GShard MoE over expert groups of 2,048 tokens
# (suite_*_moe.py, alpa/model/moe.py); Wide-ResNet in fp32 with SGD + momentum, which XLA runs on TF32 tensor
# cores where the GPU has them (JAX's default matmul precision); all with rematerialisation (use_remat=True).
GPT_SPECS = {
    "760M": (1536, 24, 16),
    "1.3B": (2048, 24, 32),
    "2.6B": (2560, 32, 32),
    "6.7B": (4096, 32, 32),
    "15B": (5120, 48, 40),
    "39B": (8192, 48, 64),
}
MOE_SPECS = {
    "690M": (768, 8, 16),
    "1.3B": (768, 16, 16),
    "2.4B": (1024, 16, 16),
    "10B": (1536, 16, 32),
    "27B": (2048, 16, 48),
    "70B": (2048, 32, 64),
}
WRESNET_SPECS = {
    "250M": (50, 160, 2),
    "500M": (50, 224, 2),
    "1B": (50, 320, 2),
    "2B": (50, 448, 2),
    "4B": (50, 640, 2),
    "6.8B": (50, 320, 16),
    "13B": (101, 320, 16),
}
_TRACE_NAME = re.compile(r"^(?P<family>bert|gpt|moe|wide_resnet)__(?P<size>[0-9.]+[MB])$")


@cache
def trace_workload(model: str, global_batch: int) -> Workload:
    """`bert__1.3B` (GPT-style, seq 1024, vocab 51200), `moe__10B` (GShard MoE, seq 1024, vocab 32000, top-2,
    expert group 2048), `wide_resnet__2B` (image 224, fp32) -> the Workload at that global batch."""
    match = _TRACE_NAME.match(model)
    if not match:
        raise ValueError(f"unknown trace model {model!r}: expected bert__<size>, moe__<size> or wide_resnet__<size>")
    family, size = match["family"], match["size"]
    specs = {"bert": GPT_SPECS, "gpt": GPT_SPECS, "moe": MOE_SPECS, "wide_resnet": WRESNET_SPECS}[family]
    if size not in specs:
        raise ValueError(f"unknown trace model {model!r}: {family} sizes are {', '.join(specs)}")
    if family in ("bert", "gpt"):
        dim, layers, heads = specs[size]
        return transformer(
            model,
            n_layers=layers,
            dim=dim,
            heads=heads,
            vocab=51200,
            seq_len=1024,
            global_batch=global_batch,
            tied=True,
            precision="fp16",
            recompute=True,
        )
    if family == "moe":
        dim, layers, experts = specs[size]
        return transformer(
            model,
            n_layers=layers,
            dim=dim,
            heads=16,
            vocab=32000,
            seq_len=1024,
            global_batch=global_batch,
            experts=experts,
            top_k=2,
            ffn=8 * dim,
            moe_every=2,
            expert_group=2048,
            precision="fp16",
            optimizer="adafactor",
            recompute=True,
            tied=True,
        )
    depth, channels, width = specs[size]
    return wide_resnet(
        model, depth=depth, base_channels=channels, width_factor=width, global_batch=global_batch, recompute=True
    )


# --- OmniModel flavors on profiled data ----------------------------------------------------------------


def _second_moment(hist_edges: list[float], hist_counts: list[int], mean: float) -> float:
    """E[L^2] of a length histogram (bin centres), rescaled so that its mean matches the exact mean."""
    total = sum(hist_counts)
    if not total:
        return mean**2
    centres = [(lo + hi) / 2 for lo, hi in itertools.pairwise(hist_edges)]
    m1 = sum(c * n for c, n in zip(centres, hist_counts)) / total
    m2 = sum(c * c * n for c, n in zip(centres, hist_counts)) / total
    return m2 * (mean / m1) ** 2 if m1 else mean**2


def omni_workload(
    args: OmniModelArgs,
    *,
    seq_len: int,
    global_batch: int,
    profile: DatasetProfile | None = None,
    name: str = "omni",
    precision: str = "bf16",
) -> Workload:
    """An OmniModel flavor: sample = one packed sequence of `seq_len` tokens. With a profile, each sequence
    holds the profiled mix (documents per sequence, their squared lengths for attention, images and audio
    clips with their encoder tokens) and its padding; without one, it is one text document."""
    llm = args.llm
    docs, sum_sq = 1.0, float(seq_len) ** 2
    images = patches = clips = audio_tokens = 0.0
    if profile is not None and profile.modalities:
        mods = profile.modalities
        mean_len = sum(m.share * m.mean for m in mods.values())
        per_seq = profile.packing_efficiency * seq_len / mean_len  # samples per packed sequence
        pad = (1 - profile.packing_efficiency) * seq_len
        docs = per_seq + (1 if pad >= 1 else 0)
        sum_sq = per_seq * sum(m.share * _second_moment(m.hist_edges, m.hist_counts, m.mean) for m in mods.values())
        sum_sq += pad**2
        if "image" in mods:
            images = per_seq * mods["image"].share
            patches = images * mods["image"].encoder_tokens_mean
        if "audio" in mods:
            clips = per_seq * mods["audio"].share
            audio_tokens = clips * mods["audio"].encoder_tokens_mean
    b = BYTES[precision]
    moe = getattr(llm, "moe", None)
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
        dtype_bytes=b,
        experts=moe.num_experts if moe else 0,
        top_k=moe.top_k if moe else 1,
        shared_expert=bool(moe and moe.shared_expert),
    )
    layers = (
        embedding("llm.embed", llm.vocab_size, llm.dim, seq_len, b),
        *([block] * llm.n_layers),
        lm_head("llm.head", llm.vocab_size, llm.dim, seq_len, dtype_bytes=b),
    )
    # Both encoders always run (the runtime feeds a dummy input to one whose modality a batch lacks, so that
    # every rank issues the same collectives): their host costs and parameters count even without data.
    v = args.vision
    side = (patches / images) ** 0.5 if images else 0.0
    merge = getattr(args, "spatial_merge", 1) ** 2  # merge x merge patches concatenated per LLM token
    encoder = [
        *vit(
            "vision",
            n_layers=v.n_layers,
            dim=v.dim,
            heads=v.n_heads,
            patches=patches,
            sum_sq=images * side**4,
            images=images,
            patch_dim=v.patch_dim,
            mlp_ratio=v.mlp_ratio,
            dtype_bytes=b,
        ),
        projector("projector.image", v.dim * merge, args.projector_mult * llm.dim, llm.dim, patches / merge, b),
    ]
    a = args.audio
    from omni_core.common.batch import audio_tokens as tokens_of

    frames = audio_tokens * 3000 / tokens_of(3000)  # the convs' subsampling, as the data path counts it
    conv = Layer(
        "audio.conv",
        params=3 * a.dim * (a.n_mels + a.dim) + 4 * a.dim,
        flops=2 * 3 * a.dim * (a.n_mels * frames + a.dim * audio_tokens),
        mm_bytes=b * 3 * (frames * (a.n_mels + a.dim) + audio_tokens * 2 * a.dim),  # unfolded windows
        mm_weight_bytes=b * 3 * a.dim * (a.n_mels + a.dim),
        act_bytes=b * frames * (a.n_mels + a.dim),
        out_bytes=b * audio_tokens * a.dim,
        mem_bytes=4 * b * frames * a.dim,
        ops=CONV_OPS,
        sample_ops=CLIP_OPS * clips,
        tensors=6,
        units=1,
    )
    per_clip = audio_tokens / clips if clips else 0.0
    blocks = transformer_block(
        "audio.block",
        dim=a.dim,
        heads=a.n_heads,
        kv_heads=a.n_heads,
        ffn=int(a.dim * a.mlp_ratio),
        tokens=audio_tokens,
        sum_sq=clips * per_clip**2,
        docs=clips,
        causal=False,
        gated=False,
        bias=True,
        dtype_bytes=b,
    )
    encoder += [
        conv,
        *([blocks] * a.n_layers),
        projector("projector.audio", a.dim, args.projector_mult * llm.dim, llm.dim, audio_tokens, b),
    ]
    # an encoder without data runs its one-window dummy through every block: one attention call each
    dummy_calls = {"vision.block": not images, "audio.block": not clips}
    encoder = [
        replace(layer, ops=layer.ops + ATTENTION_CALL_OPS) if dummy_calls.get(layer.name) else layer
        for layer in encoder
    ]
    shape = llm.shape(seq_len)
    items = images + clips  # encoder inputs per sequence: a count, so its spread is ~ 1 / sqrt(mean)
    max_item, described = 0.0, EncoderItems()
    if items:  # the longest item, r times the mean length: linear work x r, attention's x r^2
        quad = quadratic_share(encoder)
        r, modality = max(
            (m.max / m.mean, key) for key, m in profile.modalities.items() if key in ("image", "audio") and m.mean
        )
        max_item = ((1 - quad) * r + quad * r * r) / items
        # an image's length is its patches, a clip's its mel frames (the threshold's tokens)
        count, tokens, heads = (
            (images, patches / images, v.n_heads) if modality == "image" else (clips, frames / clips, a.n_heads)
        )
        described = EncoderItems(
            "vision" if modality == "image" else "audio",
            count,
            tokens,
            heads,
            quad,
            1 / items,
            4.0 * (patches * v.patch_dim + frames * a.n_mels),
        )
    return Workload(
        name,
        layers,
        global_batch,
        shape,
        encoder=tuple(encoder),
        precision=precision,
        tokens_per_sample=seq_len,
        encoder_cv=items**-0.5 if items else 0.0,
        encoder_max_item=max_item,
        items=described,
        head_dim=llm.dim // llm.n_heads,
        doc_span=sum_sq / seq_len,
    )


def quadratic_share(encoder: list[Layer] | tuple[Layer, ...]) -> float:
    """Attention's share of the encoders' forward FLOPs: the part of an item's work quadratic in its length."""
    return sum(l.attn_flops for l in encoder) / max(sum(l.flops + l.attn_flops for l in encoder), 1.0)


# --- MegaScale-Omni's workloads ------------------------------------------------------------------------

PAPER_WORKLOADS = {  # name: (model flavor, GPUs, seq_len, global batch)
    "A": ("vit-1b+llama-12b", 64, 16384, 32),
    "B": ("vit-2.4b+llama-70b", 128, 16384, 64),
    "C": ("vit-10b+llama-70b", 256, 8192, 128),
    "D": ("vit-10b+gpt-175b", 512, 8192, 256),
}
PATCH = 14
PATCHES_PER_IMAGE = 1024  # 448 x 448 px at patch 14 (32 x 32 patches)
MERGE = 4  # 2 x 2 patch merge before the projector: 256 LLM tokens per image
TEXT_DOC = 2048  # tokens per text document inside a packed sequence


def paper_workload(key: str, image_share: float) -> Workload:
    """Workload `key` (A-D) with `image_share` of the LLM's tokens coming from images (0.1 = 1:9 image:text)."""
    from omni_core.models.flavors import get_flavor

    flavor, _, seq_len, batch = PAPER_WORKLOADS[key]
    args = get_flavor(flavor, patch_size=PATCH, n_mels=128)
    v, llm = args.vision, args.llm
    image_tokens = image_share * seq_len
    images = image_tokens / (PATCHES_PER_IMAGE / MERGE)
    patches = images * PATCHES_PER_IMAGE
    text_tokens = seq_len - image_tokens
    docs = images + text_tokens / TEXT_DOC
    sum_sq = images * (PATCHES_PER_IMAGE / MERGE) ** 2 + text_tokens * TEXT_DOC
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
    )
    layers = (
        embedding("llm.embed", llm.vocab_size, llm.dim, seq_len),
        *([block] * llm.n_layers),
        lm_head("llm.head", llm.vocab_size, llm.dim, seq_len),
    )
    encoder = (
        *vit(
            "vision",
            n_layers=v.n_layers,
            dim=v.dim,
            heads=v.n_heads,
            patches=patches,
            sum_sq=images * PATCHES_PER_IMAGE**2,
            images=images,
            patch_dim=v.patch_dim,
            mlp_ratio=v.mlp_ratio,
        ),
        projector("projector.image", v.dim * MERGE, llm.dim, llm.dim, patches / MERGE),
    )
    shape = llm.shape(seq_len)
    cv = images**-0.5 if images else 0.0  # images per sequence are a count: spread ~ 1 / sqrt(mean)
    items = (
        EncoderItems(
            "vision",
            images,
            PATCHES_PER_IMAGE,
            v.n_heads,
            quadratic_share(encoder),
            1 / images,
            4.0 * patches * v.patch_dim,
        )
        if images
        else EncoderItems()
    )
    return Workload(
        f"{key}@{image_share:.1f}",
        layers,
        batch,
        shape,
        encoder=encoder,
        tokens_per_sample=seq_len,
        encoder_cv=cv,
        encoder_max_item=1 / images if images else 0.0,
        items=items,
        head_dim=llm.dim // llm.n_heads,
        doc_span=sum_sq / seq_len,
    )
