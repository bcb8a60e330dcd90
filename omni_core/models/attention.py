"""Attention over packed sequences, and the bidirectional transformer block the encoders share.

Packed documents (LLM samples, images, audio clips) are attended one SDPA call each: on CPU that is ~6x
faster than a dense block-diagonal mask (PLATFORM-NOTES.md), and attention can never cross a document.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _document_lengths(cu_seqlens: torch.Tensor | Sequence[int], total: int) -> list[int]:
    offsets = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if not offsets or offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to the {total} tokens, got {offsets}")
    lengths = [end - start for start, end in zip(offsets, offsets[1:])]
    if min(lengths, default=0) < 0:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
    return lengths


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    causal: bool,
) -> torch.Tensor:
    """Attention within each packed document: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D].

    `cu_seqlens` holds the [D+1] document offsets. Models pass them as a Python list, read from the device
    once per forward, because reading a device tensor on the host is a sync that should not happen in every
    layer. Grouped-query attention repeats each KV head for H // Hkv consecutive query heads.
    """
    lengths = _document_lengths(cu_seqlens, q.shape[0])
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    outputs = [
        # SDPA wants [heads, seq, head_dim].
        F.scaled_dot_product_attention(
            q_doc.transpose(0, 1), k_doc.transpose(0, 1), v_doc.transpose(0, 1), is_causal=causal
        ).transpose(0, 1)
        for q_doc, k_doc, v_doc in zip(q.split(lengths), k.split(lengths), v.split(lengths))
    ]
    return torch.cat(outputs)


class EncoderAttention(nn.Module):
    """Full bidirectional multi-head attention inside each document (an image, an audio clip)."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim)
        # No key bias: it adds the same score to every key of a query, which softmax cancels (zero gradient).
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        shape = (x.shape[0], self.n_heads, self.head_dim)
        q, k, v = self.wq(x).view(shape), self.wk(x).view(shape), self.wv(x).view(shape)
        return self.wo(varlen_attention(q, k, v, cu_seqlens, causal=False).flatten(1))


class EncoderBlock(nn.Module):
    """Pre-norm transformer block (ViT / Whisper encoder): LN -> attention -> residual; LN -> GELU MLP -> residual."""

    def __init__(self, dim: int, n_heads: int, mlp_ratio: float):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = EncoderAttention(dim, n_heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cu_seqlens)
        return x + self.mlp(self.mlp_norm(x))
