"""Attention over packed sequences, and the bidirectional transformer block the encoders share.

Packed documents (LLM samples, images, audio clips) are attended one SDPA call each: on CPU that is several
times faster than a dense block-diagonal mask (PLATFORM-NOTES.md), and attention can never cross a document.
On GPUs the LLM can use flex_attention with a block-sparse document mask instead (LLMArgs.attention).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


def _document_lengths(cu_seqlens: torch.Tensor | Sequence[int], total: int) -> list[int]:
    offsets = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if not offsets or offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to the {total} tokens, got {offsets}")
    lengths = [end - start for start, end in itertools.pairwise(offsets)]
    if min(lengths, default=0) < 0:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
    return lengths


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    causal: bool,
    window: int | None = None,
) -> torch.Tensor:
    """Attention within each packed document: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D].

    `cu_seqlens` holds the [D+1] document offsets. Models pass them as a Python list, read from the device
    once per forward, because reading a device tensor on the host is a sync that should not happen in every
    layer. Grouped-query attention repeats each KV head for H // Hkv consecutive query heads. `window`
    (causal only): a query attends to its `window` latest keys, itself included (Mistral's sliding window).
    """
    lengths = _document_lengths(cu_seqlens, q.shape[0])
    if window is not None and not causal:
        raise ValueError("a sliding window is defined for causal attention only")
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    # SDPA wants [batch, heads, seq, head_dim]: given 3-D tensors, CPU SDPA takes its math path and
    # materialises the [H, T, T] scores (+2.5 GB at T = 8,192), 4-D takes the fused kernel
    outputs = [
        _sdpa(q_doc, k_doc, v_doc, causal)
        if window is None or len(q_doc) <= window
        else _windowed(q_doc, k_doc, v_doc, window)
        for q_doc, k_doc, v_doc in zip(q.split(lengths), k.split(lengths), v.split(lengths))
    ]
    return torch.cat(outputs)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None = None):
    """SDPA over [T, H, D] tensors, viewed 4-D."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal and mask is None,
    )
    return out[0].transpose(0, 1)


def _windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Causal sliding-window attention of one document, in query blocks of `window`: each block sees the
    keys from `window - 1` before its first query to its last, so memory is O(T x window), never T x T."""
    outputs = []
    for start in range(0, len(q), window):
        end = min(start + window, len(q))
        first = max(0, start - window + 1)
        query = torch.arange(start, end)[:, None]
        key = torch.arange(first, end)[None, :]
        visible = (key <= query) & (key > query - window)
        outputs.append(_sdpa(q[start:end], k[first:end], v[first:end], causal=False, mask=visible.to(q.device)))
    return torch.cat(outputs)


def document_ids(cu_seqlens: torch.Tensor | Sequence[int], total: int, device=None) -> torch.Tensor:
    """[T] index of the document each packed token belongs to."""
    lengths = torch.tensor(_document_lengths(cu_seqlens, total), device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)


def document_mask(cu_seqlens: torch.Tensor | Sequence[int], total: int, causal: bool, device=None) -> torch.Tensor:
    """[T, T] bool, True where query i may attend key j: same document (and j <= i when causal)."""
    doc = document_ids(cu_seqlens, total, device)
    mask = doc[:, None] == doc[None, :]
    return mask.tril() if causal else mask


# Other implementations of `varlen_attention`'s function over the same packed layout, compared by
# benchmarks/attention_timings.py; tests check that they agree.


def block_mask_attention(q, k, v, cu_seqlens, causal: bool) -> torch.Tensor:
    """One SDPA call over all T tokens with a dense [T, T] document mask: O(T^2) memory and FLOPs."""
    mask = document_mask(cu_seqlens, q.shape[0], causal, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out.transpose(0, 1)


def masked_matmul_attention(q, k, v, cu_seqlens, causal: bool) -> torch.Tensor:
    """Textbook softmax(QK^T / sqrt(d) + mask) V, materialising the [H, T, T] scores."""
    mask = document_mask(cu_seqlens, q.shape[0], causal, q.device)
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@functools.cache
def _compiled_flex_attention():
    """flex_attention is only fused (and fast) when compiled: compile once per process, as torchtitan does."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=8)
def _document_block_mask(offsets: tuple[int, ...], causal: bool, device: torch.device):
    """Block mask of one packed layout; cached so that every layer of a forward reuses it."""
    from torch.nn.attention.flex_attention import create_block_mask

    total = offsets[-1]
    doc = document_ids(offsets, total, device)

    def mask_mod(batch, head, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    return create_block_mask(mask_mod, None, None, total, total, device=device)


def flex_document_attention(q, k, v, cu_seqlens, causal: bool) -> torch.Tensor:
    """flex_attention with a block-sparse document mask: whole blocks across documents are skipped. Compiled
    on CUDA; eager elsewhere, where it is slow and has no backward (PyTorch raises NotImplementedError on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    offsets = tuple(cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)
    block_mask = _document_block_mask(offsets, causal, q.device)
    attend = _compiled_flex_attention() if q.is_cuda else flex_attention
    out = attend(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=block_mask,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[0].transpose(0, 1)


class EncoderShard(Protocol):
    """This member's contiguous chunk of ONE encoder document (a long image or clip split over a group), and
    the attention over the whole document. A protocol so that models need not import `omni_core.parallel`;
    `omni_core.parallel.lssp.SequenceShard` is the implementation."""

    @property
    def offset(self) -> int:
        """Index in the document of this member's first token."""
        ...

    @property
    def length(self) -> int:
        """Tokens in this member's chunk."""
        ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Non-causal attention of this chunk's queries [length, H, D] over the whole document -> [length, H, D]."""
        ...


class EncoderAttention(nn.Module):
    """Full bidirectional multi-head attention inside each document (an image, an audio clip)."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim)
        # No key bias: it adds the same score to every key of a query, which softmax cancels (zero gradient).
        # SigLIP/CLIP checkpoints have one; importing drops it without changing the output.
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], shard: EncoderShard | None = None) -> torch.Tensor:
        """Packed documents x [T, dim] -> [T, dim]. With `shard`, x is this member's chunk of one document
        (`cu_seqlens` is [0, len(x)]) and the attention over the whole document runs through the shard."""
        shape = (x.shape[0], self.n_heads, self.head_dim)
        q, k, v = self.wq(x).view(shape), self.wk(x).view(shape), self.wv(x).view(shape)
        if shard is None:
            out = varlen_attention(q, k, v, cu_seqlens, causal=False)
        elif len(_document_lengths(cu_seqlens, x.shape[0])) != 1:
            raise ValueError(f"a sequence shard holds a chunk of one document, got cu_seqlens {list(cu_seqlens)}")
        else:
            out = shard.attend(q, k, v)
        return self.wo(out.flatten(1))


class EncoderBlock(nn.Module):
    """Pre-norm transformer block (ViT / Whisper encoder): LN -> attention -> residual; LN -> GELU MLP -> residual."""

    def __init__(self, dim: int, n_heads: int, mlp_ratio: float, norm_eps: float = 1e-5, activation: str = "gelu"):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.attention_norm = nn.LayerNorm(dim, eps=norm_eps)
        self.attention = EncoderAttention(dim, n_heads)
        self.mlp_norm = nn.LayerNorm(dim, eps=norm_eps)
        act = (
            nn.ReLU()
            if activation == "relu"
            else nn.GELU(approximate={"gelu": "none", "gelu_tanh": "tanh"}[activation])
        )
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), act, nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], shard: EncoderShard | None = None) -> torch.Tensor:
        """Only attention mixes tokens, so under a `shard` (see EncoderAttention) the rest runs on the chunk as is."""
        x = x + self.attention(self.attention_norm(x), cu_seqlens, shard)
        return x + self.mlp(self.mlp_norm(x))
