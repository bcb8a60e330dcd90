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
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING

from omni_core.parallel import ModelShape

if TYPE_CHECKING:
    from omni_core.data.profile import DatasetProfile
    from omni_core.models.args import OmniModelArgs

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Layer:
    """One layer's costs per sample (forward). Backward is priced as 2x forward FLOPs by the cost model."""

    name: str
    params: float
    flops: float  # weight matmul / conv FLOPs
    attn_flops: float = 0.0  # attention scores and context (QK^T, AV): no weights, quadratic in document length
    act_bytes: float = 0.0  # activations kept for backward without checkpointing
    out_bytes: float = 0.0  # the output: what checkpointing keeps and what a pipeline stage sends on
    mem_bytes: float = 0.0  # memory-bound traffic (norms, activation functions, residuals, softmax)
    tp_bytes: float = 0.0  # bytes all-reduced across TP ranks per forward (backward: the same again)
    a2a_bytes: float = 0.0  # bytes dispatched to experts per forward all-to-all (dispatch + combine = 2)
    expert_params: float = 0.0  # of `params`, those sharded by expert parallelism
    ops: float = 0.0  # kernels / operator calls per micro-batch forward (launch or dispatch overhead)
    attn_calls: float = 0.0  # attention calls per sample (one per packed document on the CPU runtime)


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
    prefix: dict[str, tuple[float, ...]] = field(default_factory=dict, compare=False, repr=False)
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # stage partitions by pp

    def __post_init__(self) -> None:
        for name in _SUMMED:
            running, sums = 0.0, [0.0]
            for layer in self.llm:
                running += getattr(layer, name)
                sums.append(running)
            self.prefix[name] = tuple(sums)

    def span(self, name: str, start: int, stop: int) -> float:
        """Sum of a Layer field over llm[start:stop] in O(1)."""
        sums = self.prefix[name]
        return sums[stop] - sums[start]

    def encoder_total(self, name: str) -> float:
        return sum(getattr(layer, name) for layer in self.encoder)

    @property
    def params(self) -> float:
        return sum(layer.params for layer in self.llm + self.encoder)

    @property
    def is_moe(self) -> bool:
        return self.shape.num_experts > 0


_SUMMED = ("params", "flops", "attn_flops", "act_bytes", "mem_bytes", "tp_bytes", "a2a_bytes", "expert_params",
           "ops", "attn_calls")


# --- transformers --------------------------------------------------------------------------------------


def transformer_block(
    name: str, *, dim: int, heads: int, kv_heads: int, ffn: int, tokens: float, sum_sq: float, docs: float,
    causal: bool, gated: bool, bias: bool, dtype_bytes: int = 2, experts: int = 0, top_k: int = 1,
) -> Layer:
    """A pre-norm attention + MLP block over `tokens` per sample, `docs` documents whose squared lengths
    sum to `sum_sq`. MoE: `experts` FFNs, `top_k` of them per token (GShard: 2)."""
    head_dim = dim // heads
    attn_params = dim * (heads + 2 * kv_heads) * head_dim + heads * head_dim * dim
    mats = 3 if gated else 2
    ffn_params = mats * dim * ffn
    bias_params = (dim * 3 + dim + ffn * (mats - 1) + dim) if bias else 0
    norm_params = 2 * dim * (2 if bias else 1)
    active_ffn = ffn_params * (top_k if experts else 1)
    router = dim * experts
    attn_pairs = sum_sq * (0.5 if causal else 1.0)
    b = dtype_bytes
    return Layer(
        name=name,
        params=attn_params + ffn_params * max(experts, 1) + bias_params + norm_params + router,
        flops=2 * tokens * (attn_params + active_ffn + router),
        attn_flops=4 * head_dim * heads * attn_pairs,
        # Korthikanti et al. 2022 (flash attention: no s^2 term): inputs of each matmul, norm and activation
        act_bytes=b * tokens * (8 * dim + 2 * kv_heads * head_dim + (mats + 1) * ffn * (top_k if experts else 1)),
        out_bytes=b * tokens * dim,
        mem_bytes=b * tokens * (14 * dim + (mats + 1) * ffn * (top_k if experts else 1)),
        tp_bytes=2 * b * tokens * dim,  # two all-reduces (or RS + AG with sequence parallel) per forward
        a2a_bytes=b * tokens * dim * top_k if experts else 0.0,
        expert_params=ffn_params * experts if experts else 0.0,
        ops=24 + (6 if experts else 0),
        attn_calls=docs,
    )


def embedding(name: str, vocab: int, dim: int, tokens: float, dtype_bytes: int = 2) -> Layer:
    return Layer(name, params=vocab * dim, flops=0.0, out_bytes=dtype_bytes * tokens * dim,
                 mem_bytes=2 * dtype_bytes * tokens * dim, ops=2)


def lm_head(name: str, vocab: int, dim: int, tokens: float, tied: bool = False, dtype_bytes: int = 2) -> Layer:
    """Final norm + vocabulary projection + cross-entropy; the fp32 logits dominate its activations."""
    return Layer(
        name, params=0 if tied else vocab * dim, flops=2 * tokens * vocab * dim,
        act_bytes=tokens * (dtype_bytes * dim + 4 * vocab), out_bytes=0.0,
        mem_bytes=tokens * (3 * 4 * vocab + 4 * dtype_bytes * dim), tp_bytes=4 * tokens, ops=12,
    )


def transformer(
    name: str, *, n_layers: int, dim: int, heads: int, vocab: int, seq_len: int, global_batch: int,
    kv_heads: int | None = None, ffn: int | None = None, gated: bool = False, bias: bool = True,
    experts: int = 0, top_k: int = 2, doc_len: float | None = None, precision: str = "bf16", tied: bool = False,
) -> Workload:
    """A decoder-only LM (GPT with `gated=False, bias=True`; Llama with `gated=True, bias=False`), dense or
    MoE (`experts` > 0: every block's FFN is a mixture, as in the Alpa/Crius `moe__*` models). Samples are
    sequences of `seq_len` tokens made of documents of `doc_len` (default: one document per sequence)."""
    kv_heads = kv_heads or heads
    ffn = ffn or 4 * dim
    doc_len = min(doc_len or seq_len, seq_len)
    docs = seq_len / doc_len
    b = BYTES[precision]
    block = transformer_block(
        "block", dim=dim, heads=heads, kv_heads=kv_heads, ffn=ffn, tokens=seq_len, sum_sq=docs * doc_len**2,
        docs=docs, causal=True, gated=gated, bias=bias, dtype_bytes=b, experts=experts, top_k=top_k,
    )
    layers = (embedding("embed", vocab, dim, seq_len, b), *([block] * n_layers), lm_head("head", vocab, dim, seq_len, tied, b))
    shape = ModelShape(n_layers=n_layers, n_heads=heads, n_kv_heads=kv_heads, num_experts=experts, seq_len=seq_len)
    return Workload(name, layers, global_batch, shape, precision=precision, tokens_per_sample=seq_len)


def vit(name: str, *, n_layers: int, dim: int, heads: int, patches: float, sum_sq: float, images: float,
        patch_dim: int, mlp_ratio: float = 4.0, dtype_bytes: int = 2) -> tuple[Layer, ...]:
    """A ViT over `patches` per sample in `images` documents (bidirectional attention per image)."""
    block = transformer_block(
        f"{name}.block", dim=dim, heads=heads, kv_heads=heads, ffn=int(dim * mlp_ratio), tokens=patches,
        sum_sq=sum_sq, docs=images, causal=False, gated=False, bias=True, dtype_bytes=dtype_bytes,
    )
    b = dtype_bytes
    embed = Layer(f"{name}.patch_embed", params=patch_dim * dim + dim, flops=2 * patches * patch_dim * dim,
                  act_bytes=b * patches * patch_dim, out_bytes=b * patches * dim, mem_bytes=4 * b * patches * dim,
                  ops=6)
    return (embed, *([block] * n_layers))


def projector(name: str, in_dim: int, hidden: int, out_dim: int, tokens: float, dtype_bytes: int = 2) -> Layer:
    params = in_dim * hidden + hidden + hidden * out_dim + out_dim
    b = dtype_bytes
    return Layer(name, params=params, flops=2 * tokens * (in_dim * hidden + hidden * out_dim),
                 act_bytes=b * tokens * (in_dim + 2 * hidden), out_bytes=b * tokens * out_dim,
                 mem_bytes=b * tokens * (3 * hidden + 2 * out_dim), tp_bytes=b * tokens * out_dim, ops=6)


# --- Wide-ResNet (Alpa benchmark suite) ------------------------------------------------------------------


def wide_resnet(name: str, *, depth: int, base_channels: int, width_factor: int, global_batch: int,
                image: int = 224, classes: int = 1024, precision: str = "fp32") -> Workload:
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
    layers = [Layer("stem", params=p + 2 * base_channels, flops=f, act_bytes=b * (3 * image**2 + 2 * base_channels * side**2 * 4),
                    out_bytes=b * base_channels * side**2, mem_bytes=6 * b * base_channels * side**2 * 4, ops=4)]
    cin = base_channels
    for i, blocks in enumerate(stages):
        filters = base_channels * 2**i
        for j in range(blocks):
            out_side = side // 2 if (i > 0 and j == 0) else side
            parts = [conv(cin, filters, 1, side), conv(filters, filters * width_factor, 3, out_side),
                     conv(filters * width_factor, 4 * filters, 1, out_side)]
            if cin != 4 * filters or out_side != side:
                parts.append(conv(cin, 4 * filters, 1, out_side))
            acts = cin * side**2 + (filters + filters * width_factor + 4 * filters) * out_side**2
            layers.append(Layer(
                f"stage{i}.block{j}", params=sum(p for p, _ in parts) + 2 * (2 * filters + filters * width_factor + 4 * filters),
                flops=sum(f for _, f in parts), act_bytes=2 * b * acts, out_bytes=b * 4 * filters * out_side**2,
                mem_bytes=4 * b * acts, ops=12,
            ))
            cin, side = 4 * filters, out_side
    layers.append(Layer("head", params=cin * classes + classes, flops=2 * cin * classes, act_bytes=b * cin,
                        mem_bytes=b * cin * side**2, ops=4))
    # n_heads=1: the plan object then refuses tp > 1 (convolutions are not tensor-parallel here)
    shape = ModelShape(n_layers=len(layers), n_heads=1, n_kv_heads=1)
    return Workload(name, tuple(layers), global_batch, shape, precision=precision)


# --- the Crius trace's models --------------------------------------------------------------------------

# Alpa benchmark suite shapes (README of shared/data): (hidden, layers, heads) and MoE (hidden, layers, experts)
GPT_SPECS = {"760M": (1536, 24, 16), "1.3B": (2048, 24, 32), "2.6B": (2560, 32, 32), "6.7B": (4096, 32, 32),
             "15B": (5120, 48, 40), "39B": (8192, 48, 64)}
MOE_SPECS = {"690M": (768, 8, 16), "1.3B": (768, 16, 16), "2.4B": (1024, 16, 16), "10B": (1536, 16, 32),
             "27B": (2048, 16, 48), "70B": (2048, 32, 64)}
WRESNET_SPECS = {"250M": (50, 160, 2), "500M": (50, 224, 2), "1B": (50, 320, 2), "2B": (50, 448, 2),
                 "4B": (50, 640, 2), "6.8B": (50, 320, 16), "13B": (101, 320, 16)}
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
        return transformer(model, n_layers=layers, dim=dim, heads=heads, vocab=51200, seq_len=1024,
                           global_batch=global_batch, tied=True)
    if family == "moe":
        dim, layers, experts = specs[size]
        return transformer(model, n_layers=layers, dim=dim, heads=dim // 64, vocab=32000, seq_len=1024,
                           global_batch=global_batch, experts=experts, top_k=2)
    depth, channels, width = specs[size]
    return wide_resnet(model, depth=depth, base_channels=channels, width_factor=width, global_batch=global_batch)


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
    args: OmniModelArgs, *, seq_len: int, global_batch: int, profile: DatasetProfile | None = None,
    name: str = "omni", precision: str = "bf16",
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
    experts = moe.num_experts + (1 if moe.shared_expert else 0) if moe else 0
    block = transformer_block(
        "llm.block", dim=llm.dim, heads=llm.n_heads, kv_heads=llm.n_kv_heads, ffn=llm.ffn_hidden, tokens=seq_len,
        sum_sq=sum_sq, docs=docs, causal=True, gated=True, bias=False, dtype_bytes=b, experts=experts,
        top_k=(moe.top_k + (1 if moe.shared_expert else 0)) if moe else 1,
    )
    layers = (embedding("llm.embed", llm.vocab_size, llm.dim, seq_len, b), *([block] * llm.n_layers),
              lm_head("llm.head", llm.vocab_size, llm.dim, seq_len, dtype_bytes=b))
    encoder: list[Layer] = []
    if patches:
        v = args.vision
        side = (patches / images) ** 0.5
        encoder += vit("vision", n_layers=v.n_layers, dim=v.dim, heads=v.n_heads, patches=patches,
                       sum_sq=images * side**4, images=images, patch_dim=v.patch_dim, mlp_ratio=v.mlp_ratio,
                       dtype_bytes=b)
        merge = getattr(args, "spatial_merge", 1) ** 2  # merge x merge patches concatenated per LLM token
        encoder.append(projector("projector.image", v.dim * merge, args.projector_mult * llm.dim, llm.dim,
                                 patches / merge, b))
    if audio_tokens:
        a = args.audio
        from omni_core.data.batch import audio_tokens as tokens_of

        frames = audio_tokens * 3000 / tokens_of(3000)  # the convs' subsampling, as the data path counts it
        conv = Layer("audio.conv", params=3 * a.dim * (a.n_mels + a.dim) + 2 * a.dim,
                     flops=2 * 3 * a.dim * (a.n_mels * frames + a.dim * audio_tokens),
                     act_bytes=b * frames * (a.n_mels + a.dim), out_bytes=b * audio_tokens * a.dim,
                     mem_bytes=4 * b * frames * a.dim, ops=8 * clips)
        per_clip = audio_tokens / clips
        blocks = transformer_block(
            "audio.block", dim=a.dim, heads=a.n_heads, kv_heads=a.n_heads, ffn=int(a.dim * a.mlp_ratio),
            tokens=audio_tokens, sum_sq=clips * per_clip**2, docs=clips, causal=False, gated=False, bias=True,
            dtype_bytes=b,
        )
        encoder += [conv, *([blocks] * a.n_layers),
                    projector("projector.audio", a.dim, args.projector_mult * llm.dim, llm.dim, audio_tokens, b)]
    shape = ModelShape(n_layers=llm.n_layers, n_heads=llm.n_heads, n_kv_heads=llm.n_kv_heads,
                       num_experts=moe.num_experts if moe else 0, seq_len=seq_len)
    items = images + clips  # encoder inputs per sequence: a count, so its spread is ~ 1 / sqrt(mean)
    return Workload(name, layers, global_batch, shape, encoder=tuple(encoder), precision=precision,
                    tokens_per_sample=seq_len, encoder_cv=items**-0.5 if items else 0.0)


# --- MegaScale-Omni's workloads ------------------------------------------------------------------------

PAPER_WORKLOADS = {  # name: (model flavor, GPUs, seq_len, global batch)
    "A": ("vit-1b+llama-12b", 64, 16384, 32), "B": ("vit-2.4b+llama-70b", 128, 16384, 64),
    "C": ("vit-10b+llama-70b", 256, 8192, 128), "D": ("vit-10b+gpt-175b", 512, 8192, 256),
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
    block = transformer_block("llm.block", dim=llm.dim, heads=llm.n_heads, kv_heads=llm.n_kv_heads,
                              ffn=llm.ffn_hidden, tokens=seq_len, sum_sq=sum_sq, docs=docs, causal=True, gated=True,
                              bias=False)
    layers = (embedding("llm.embed", llm.vocab_size, llm.dim, seq_len), *([block] * llm.n_layers),
              lm_head("llm.head", llm.vocab_size, llm.dim, seq_len))
    encoder = (*vit("vision", n_layers=v.n_layers, dim=v.dim, heads=v.n_heads, patches=patches,
                    sum_sq=images * PATCHES_PER_IMAGE**2, images=images, patch_dim=v.patch_dim, mlp_ratio=v.mlp_ratio),
               projector("projector.image", v.dim * MERGE, llm.dim, llm.dim, patches / MERGE))
    shape = ModelShape(n_layers=llm.n_layers, n_heads=llm.n_heads, n_kv_heads=llm.n_kv_heads, seq_len=seq_len)
    cv = images**-0.5 if images else 0.0  # images per sequence are a count: spread ~ 1 / sqrt(mean)
    return Workload(f"{key}@{image_share:.1f}", layers, batch, shape, encoder=encoder, tokens_per_sample=seq_len,
                    encoder_cv=cv)
