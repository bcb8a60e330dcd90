"""Llama/Qwen2-style decoder backbone over packed sequences: RMSNorm, GQA attention with RoPE, SwiGLU FFN or
a mixture of SwiGLU experts."""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from omni_core.common.batch import BatchLayout
from omni_core.models.args import LLMArgs, RopeScaling
from omni_core.models.attention import DocumentAttention
from omni_core.models.documents import PackedDocuments
from omni_core.models.feed_forward import FeedForward, MoE
from omni_core.models.kv_cache import KVCache


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> tuple[torch.Tensor, float]:
    """The [head_dim / 2] rotary inverse frequencies and the factor cos/sin are scaled by (1 but for yarn)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = theta**-exponents
    if scaling is None:
        return inv_freq, 1.0
    factor = scaling.factor
    if scaling.kind == "linear":
        return inv_freq / factor, 1.0
    original = scaling.original_max_positions
    assert original is not None  # RopeScaling requires it for llama3 and yarn
    if scaling.kind == "llama3":
        # wavelengths longer than original / low_freq_factor are stretched by factor, shorter than
        # original / high_freq_factor kept, those between blended by where they fall
        wavelength = 2 * math.pi / inv_freq
        blend = (original / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - blend) * inv_freq / factor + blend * inv_freq
        stretched = torch.where(wavelength > original / scaling.low_freq_factor, inv_freq / factor, inv_freq)
        medium = (wavelength <= original / scaling.low_freq_factor) & (
            wavelength >= original / scaling.high_freq_factor
        )
        return torch.where(medium, blended, stretched), 1.0

    # yarn: dimensions that turn fewer than beta_slow times over the original context are interpolated, those
    # that turn more than beta_fast times kept, with a linear ramp between
    def dimension_turning(turns: float) -> float:
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_turning(scaling.beta_fast), dimension_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention = scaling.attention_factor
    if attention is None:
        attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, attention


def rope_cos_sin(position_ids: torch.Tensor, args: LLMArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, 1, head_dim] for each token's position inside its document.

    Computed per forward rather than cached in a buffer: it is cheap, and a model built on the meta device
    then has no state that initialisation must remember to recompute.
    """
    inv_freq, scale = rope_frequencies(args.dim // args.n_heads, args.rope_theta, args.rope_scaling)
    angles = position_ids.to(torch.float32)[:, None] * inv_freq.to(position_ids.device)[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, H, head_dim] by position, in the half-split layout of Hugging Face Llama checkpoints."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(DocumentAttention):
    """Causal grouped-query self-attention inside each packed document."""

    def __init__(self, args: LLMArgs, window: int | None = None):
        super().__init__(args.attention)
        self.window = window  # sliding window (keys per query), None: the whole document
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: PackedDocuments) -> torch.Tensor:
        tokens = x.shape[0]
        # -1 heads: under tensor parallelism each rank holds a slice of the heads
        q = self.wq(x).view(tokens, -1, self.head_dim)
        k = self.wk(x).view(tokens, -1, self.head_dim)
        v = self.wv(x).view(tokens, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # `attend` is context parallelism's where it applies (ParallelPlan.check_model refuses it under a window)
        out = self.attention(q, k, v, docs, causal=True, window=self.window)
        return self.wo(out.flatten(1))

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: str
    ) -> torch.Tensor:
        """[B, S, dim] new tokens of left-padded rows -> [B, S, dim], attending to `cache`'s columns and to
        themselves; their keys and values join the cache."""
        rows, new = x.shape[:2]
        q = apply_rope(self.wq(x).view(rows, new, -1, self.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(self.wk(x).view(rows, new, -1, self.head_dim), cos, sin).transpose(1, 2)
        v = self.wv(x).view(rows, new, -1, self.head_dim).transpose(1, 2)
        k, v = cache.append(layer, k, v)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # SDPA's enable_gqa needs torch 2.5 and not every backend takes it; repeating is exact
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.mask(new, self.window))
        return self.wo(out.transpose(1, 2).flatten(2))


class TransformerBlock(nn.Module):
    def __init__(self, args: LLMArgs, layer: int = 0):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, args.window(layer))
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = args.moe is not None
        if args.moe is not None:
            self.moe = MoE(args.dim, args.ffn_hidden, args.moe, args.activation)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden, args.activation)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: PackedDocuments) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, docs)
        return x + (self.moe if self.moe_enabled else self.feed_forward)(self.ffn_norm(x))

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: str
    ) -> torch.Tensor:
        x = x + self.attention.forward_cached(self.attention_norm(x), cos, sin, cache, layer)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return x + ffn(self.ffn_norm(x).flatten(0, 1)).view_as(x)  # MoE routes flat [T, dim] tokens


class LLM(nn.Module):
    """Decoder over flat packed tokens. Takes embeddings, not ids, so encoder outputs can be anchored first.

    A pipeline stage is this module with some `layers` deleted and `tok_embeddings` (all but the first
    stage) or `norm` and `output` (all but the last) set to None; parameter names stay those of the whole
    model, so checkpoints move between pipeline layouts.

    After each forward, `aux_loss` is the MoE load-balancing loss already weighted by `aux_loss_coef` and
    summed over layers (a zero tensor for a dense model): the trainer adds it to the LM loss. It is an
    attribute rather than a second return value so that `forward -> logits` stays the same for every model.
    """

    def __init__(self, args: LLMArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by layer index so that pipeline stages can drop layers and keep the other names unchanged.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tied_embeddings:  # one parameter (ParallelPlan.check_model refuses plans that would split it)
            self.output.weight = self.tok_embeddings.weight
        self.aux_loss: torch.Tensor | None = None  # set by forward; not state, so a meta-device build is fine

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(input_ids)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        layout: BatchLayout | None = None,
    ) -> torch.Tensor:
        """[T, dim] embeddings, [T] positions inside each document, [D+1] document offsets -> logits [T, vocab].

        `layout`: the batch's host layout (`PackedBatch.layout`), whose offsets and padding documents attention
        takes without reading `cu_seqlens` back from the device; without it `cu_seqlens` is read once (a sync)."""
        cos, sin = rope_cos_sin(position_ids, self.args)
        if layout is None:
            docs = PackedDocuments.of(cu_seqlens)
        else:
            docs = PackedDocuments(layout.doc_offsets, frozenset(layout.padding_docs), cu_seqlens)
        h = inputs_embeds
        for layer in self.layers.values():
            h = layer(h, cos, sin, docs)
        aux = self.moe_aux_losses()
        moe = self.args.moe
        self.aux_loss = moe.aux_loss_coef * torch.stack(aux).sum() if moe is not None and aux else h.new_zeros(())
        if self.output is None:  # a pipeline stage before the last one hands on hidden states
            return h
        return self.output(self.norm(h))

    def forward_cached(self, inputs_embeds: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Decoding: [B, S, dim] embeddings of the next S columns of `cache`'s left-padded rows -> logits
        [B, S, vocab]. The packed `forward` stays the training path; this one serves generation, where each
        step's keys and values are kept rather than recomputed. The whole model on one device only."""
        if self.output is None or self.norm is None or len(self.layers) != self.args.n_layers:
            raise ValueError("cached decoding needs the whole LLM (not a pipeline stage)")
        rows, new = inputs_embeds.shape[:2]
        cos, sin = rope_cos_sin(cache.positions(new).flatten(), self.args)
        cos, sin = cos.view(rows, new, 1, -1), sin.view(rows, new, 1, -1)
        h = inputs_embeds
        for name, layer in self.layers.items():
            h = cast(TransformerBlock, layer).forward_cached(h, cos, sin, cache, name)
        cache.length += new
        return self.output(self.norm(h))

    def moe_aux_losses(self) -> list[torch.Tensor]:
        """The unweighted load-balancing loss of each MoE layer this module holds, as the last forward set it."""
        losses = []
        for layer in self.layers.values():
            block = cast(TransformerBlock, layer)
            if block.moe_enabled:
                assert block.moe.aux_loss is not None  # set by the forward that just ran
                losses.append(block.moe.aux_loss)
        return losses
