"""Attention over packed sequences, and the bidirectional transformer block the encoders share.

Packed documents (LLM samples, images, audio clips) never attend to each other. `varlen_attention` runs it one of
three ways (`model.attention`, `args.AttentionKind`): FlashAttention over all documents in one call on CUDA
(`varlen`, torch.nn.attention.varlen), one SDPA call per document (`sdpa`: on CPU several times faster than a
dense block-diagonal mask, PLATFORM-NOTES.md), or flex_attention with a block-sparse document mask (`flex`).
Documents made of padding alone are never attended: their outputs are zeros (their labels are -100).

Every path takes the layout's host integers (offsets, lengths) from `PackedDocuments`, never from a device
tensor, so no layer waits for the GPU. Under torch.compile attention runs outside the graph (`attend_outside_graph`),
so that a packed layout's integers never become graph constants and a block compiles once for every layout.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from omni_core.models.args import AttentionKind, VarlenSupport, attention_problem
from omni_core.models.documents import Offsets, PackedDocuments, document_ids, document_mask

# --- choosing a path ------------------------------------------------------------------------------------------


@functools.cache
def varlen_support() -> VarlenSupport | None:
    """What this torch's varlen_attn takes, read from its signature: torch 2.9 has `is_causal` and equal head
    counts; 2.10 adds `window_size`; `enable_gqa` came later (2.12's documentation has it). None: no varlen_attn."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    return VarlenSupport(windows="window_size" in parameters, gqa="enable_gqa" in parameters)


def resolve_attention(kind: str, q: torch.Tensor, window: bool = False) -> str:
    """The path `kind` takes for these queries: auto is varlen where it runs (CUDA, bf16/fp16, a head dim
    FlashAttention takes), else sdpa. An explicit varlen that cannot run is refused by the rule the recipe check
    applies (`args.attention_problem`), naming the setting."""
    if kind in ("sdpa", "flex"):
        return kind
    problem = attention_problem(
        "varlen", q.device.type, str(q.dtype).removeprefix("torch."), varlen_support(), (q.shape[-1],), window
    )
    if kind == "auto":
        return "sdpa" if problem else "varlen"
    if kind != "varlen":
        raise ValueError(f"model.attention={kind!r}: {attention_problem(kind, 'cpu', 'float32', None)}")
    if problem:
        raise ValueError(f"model.attention=varlen: {problem}")
    return kind


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: Offsets | PackedDocuments,
    causal: bool,
    window: int | None = None,
    kind: str = "auto",
) -> torch.Tensor:
    """Attention within each packed document: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D].

    `documents`: the layout (`PackedDocuments`) or its [D+1] offsets. Grouped-query attention: each KV head serves
    H // Hkv consecutive query heads. `window` (causal only): a query attends to its `window` latest keys, itself
    included (Mistral's sliding window). `kind`: the path (`resolve_attention`). Rows of padding documents are 0.
    """
    docs = PackedDocuments.of(documents)
    if docs.total != q.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to the {q.shape[0]} tokens, got {list(docs.offsets)}")
    if window is not None and not causal:
        raise ValueError("a sliding window is defined for causal attention only")
    path = resolve_attention(kind, q, window is not None)
    if path == "varlen":
        return flash_varlen_attention(q, k, v, docs, causal, window)
    if path == "flex":
        return flex_document_attention(q, k, v, docs, causal, window)
    return sdpa_document_attention(q, k, v, docs, causal, window)


class AttendFn(Protocol):
    """`varlen_attention`'s call, which context parallelism's attention also takes (`parallel.context`)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: PackedDocuments,
        causal: bool,
        window: int | None = None,
        kind: str = "auto",
    ) -> torch.Tensor: ...


def attend_outside_graph(
    attend: AttendFn, q, k, v, documents: Offsets | PackedDocuments, *, causal: bool, window: int | None, kind: str
) -> torch.Tensor:
    """`attend(...)`, run eagerly also inside a compiled block once `keep_attention_out_of_graphs` was called:
    the kernels read the layout's host integers (split sizes, the longest document), which a graph would bake
    in as constants and recompile for at every new layout. The graph breaks here cost nothing the compiler
    could fuse (attention is one opaque kernel). The output's token dimension is marked dynamic so that the
    graph resuming after it compiles once."""
    return _attend_eagerly(attend, q, k, v, documents, causal=causal, window=window, kind=kind)


def _attend(attend: AttendFn, q, k, v, documents, *, causal: bool, window: int | None, kind: str) -> torch.Tensor:
    out = attend(q, k, v, PackedDocuments.of(documents), causal=causal, window=window, kind=kind)
    mark_tokens_dynamic(out)
    return out


_attend_eagerly = _attend  # torch.compiler.disable(_attend) once blocks are compiled


def keep_attention_out_of_graphs() -> None:
    """From now on attention runs outside compiled graphs (`parallel.parallelize.apply_compile` calls it before
    compiling). Not done at import: torch.compiler.disable loads dynamo, seconds that an eager run never needs."""
    global _attend_eagerly
    _attend_eagerly = torch.compiler.disable(_attend)


def mark_tokens_dynamic(*tensors: object) -> None:
    """Mark dim 0 (tokens) of these tensors dynamic for torch.compile, so that a graph taking them compiles once
    for every token count rather than once per count and again when a count changes. Only where dynamo is
    loaded (no compiled graph exists without it; importing it costs seconds). `torch._dynamo.maybe_mark_dynamic`
    is private (torch >= 2.2 through 2.13); where it is missing nothing is marked and dynamo's automatic dynamic
    shapes apply instead (one recompile per graph, at the first new count)."""
    dynamo = sys.modules.get("torch._dynamo")
    mark = getattr(dynamo, "maybe_mark_dynamic", None)
    if mark is None:
        return
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
            mark(tensor, 0)


# --- the paths --------------------------------------------------------------------------------------------------


def sdpa_document_attention(q, k, v, documents, causal: bool, window: int | None = None) -> torch.Tensor:
    """One SDPA call per document, split at the layout's host offsets (no sync); padding documents are zeros."""
    docs = PackedDocuments.of(documents)
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    outputs = []
    for start, end, padding in docs.runs:
        if padding:
            outputs.append(q.new_zeros(end - start, q.shape[1], v.shape[2]))
        elif window is None or end - start <= window:
            outputs.append(_sdpa(q[start:end], k[start:end], v[start:end], causal))
        else:
            outputs.append(_windowed(q[start:end], k[start:end], v[start:end], window))
    return torch.cat(outputs) if outputs else q.new_zeros(0, q.shape[1], v.shape[2])


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None = None):
    """SDPA over [T, H, D] tensors, viewed 4-D: given 3-D tensors, CPU SDPA takes its math path and materialises
    the [H, T, T] scores (+2.5 GB at T = 8,192), 4-D takes the fused kernel."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal and mask is None,
    )
    return out[0].transpose(0, 1)


def _windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Causal sliding-window attention of one document longer than `window`, in query blocks of `window`: each
    block sees the keys from `window - 1` before its first query to its last, so memory is O(T x window). Every
    block after the first (plain causal) shares one band mask, built on the device once."""
    band = _band_mask(window, q.device)
    outputs = [_sdpa(q[:window], k[:window], v[:window], causal=True)]
    for start in range(window, len(q), window):
        end = min(start + window, len(q))
        rows, first = end - start, start - window + 1
        outputs.append(
            _sdpa(q[start:end], k[first:end], v[first:end], causal=False, mask=band[:rows, : rows + window - 1])
        )
    return torch.cat(outputs)


@functools.lru_cache(maxsize=8)
def _band_mask(window: int, device: torch.device) -> torch.Tensor:
    """[window, 2 * window - 1] bool: query i of a block sees block keys i .. i + window - 1 (the block's keys
    start window - 1 before its first query)."""
    return torch.ones(window, 2 * window - 1, dtype=torch.bool, device=device).triu().tril(window - 1)


def flash_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents, causal: bool, window: int | None = None
) -> torch.Tensor:
    """FlashAttention over every document in one call (torch.nn.attention.varlen, CUDA): int32 offsets on the
    device, the longest document as a host int. Padding documents are left out of the call (their rows are
    gathered out and come back as zeros). Sliding windows and grouped-query heads run natively where this torch's
    varlen_attn takes them (`varlen_support`); without `enable_gqa` the KV heads are repeated."""
    from torch.nn.attention.varlen import varlen_attn

    support = varlen_support()
    assert support is not None, "resolve_attention chooses varlen only where torch has it"
    docs = PackedDocuments.of(documents)
    offsets, longest, spans = docs.attended
    tokens = q.shape[0]
    if not offsets[-1]:  # padding alone
        return q.new_zeros(tokens, q.shape[1], v.shape[2])
    if spans is not None:
        index = docs.on_device("index", q.device)
        q, k, v = (x.index_select(0, index) for x in (q, k, v))
    options: dict = {}
    if k.shape[1] != q.shape[1] and support.gqa:
        options["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    if support.windows:
        options["window_size"] = (-1 if window is None else window - 1, 0 if causal else -1)
    elif window is not None:
        raise ValueError("this torch's varlen_attn has no window_size (torch >= 2.10) for the sliding window")
    else:
        options["is_causal"] = causal
    cu_seqlens = docs.on_device("cu_seqlens", q.device)
    out = cast(torch.Tensor, varlen_attn(q, k, v, cu_seqlens, cu_seqlens, longest, longest, **options))
    if spans is None:
        return out
    return out.new_zeros(tokens, *out.shape[1:]).index_copy(0, index, out)


def flex_document_attention(q, k, v, documents, causal: bool, window: int | None = None) -> torch.Tensor:
    """flex_attention with a block-sparse document mask: whole blocks across documents, and padding, are skipped.
    Compiled on CUDA; eager elsewhere, where it is slow and has no backward (PyTorch raises NotImplementedError)."""
    from torch.nn.attention.flex_attention import flex_attention

    docs = PackedDocuments.of(documents)
    block_mask = _document_block_mask(docs.offsets, docs.padding, causal, window, q.device)
    attend = _compiled_flex_attention() if q.is_cuda else flex_attention
    out = attend(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=block_mask,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[0].transpose(0, 1)


@functools.cache
def _compiled_flex_attention():
    """flex_attention is only fused (and fast) when compiled: compile once per process, as torchtitan does."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


@functools.lru_cache(maxsize=8)
def _document_block_mask(
    offsets: tuple[int, ...], padding: frozenset[int], causal: bool, window: int | None, device: torch.device
):
    """Block mask of one packed layout; cached so that every layer of a forward reuses it. A padding query sees
    no key (flex_attention then returns 0 for it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids(PackedDocuments(offsets, padding), device, padding=True)

    def mask_mod(batch, head, q_idx, kv_idx):
        visible = (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] >= 0)
        if causal:
            visible = visible & (kv_idx <= q_idx)
        if window is not None:
            visible = visible & (q_idx - kv_idx < window)
        return visible

    total = offsets[-1]
    return create_block_mask(mask_mod, None, None, total, total, device=device)


# Dense baselines over the same layout (padding documents attended as documents), which
# benchmarks/attention_timings.py times against the paths above; tests check that they agree.


def block_mask_attention(q, k, v, documents, causal: bool) -> torch.Tensor:
    """One SDPA call over all T tokens with a dense [T, T] document mask: O(T^2) memory and FLOPs."""
    mask = document_mask(documents, causal, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out.transpose(0, 1)


def masked_matmul_attention(q, k, v, documents, causal: bool) -> torch.Tensor:
    """Textbook softmax(QK^T / sqrt(d) + mask) V, materialising the [H, T, T] scores."""
    mask = document_mask(documents, causal, q.device)
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


# --- modules ----------------------------------------------------------------------------------------------------


class DocumentAttention(nn.Module):
    """What every attention module of the model shares: the path it takes (`kind`, set for the whole model by
    `set_attention`) and the function it attends with (`attend`; context parallelism installs its own)."""

    def __init__(self, kind: AttentionKind = "auto"):
        super().__init__()
        self.kind: str = kind
        self.attend: AttendFn = varlen_attention

    def attention(self, q, k, v, documents: Offsets | PackedDocuments, causal: bool, window: int | None = None):
        return attend_outside_graph(self.attend, q, k, v, documents, causal=causal, window=window, kind=self.kind)


def set_attention(model: nn.Module, kind: str) -> None:
    """Every attention of `model` (the LLM's and the encoders') takes path `kind` (the recipe's model.attention)."""
    for module in model.modules():
        if isinstance(module, DocumentAttention):
            module.kind = kind


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


class EncoderAttention(DocumentAttention):
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

    def forward(
        self, x: torch.Tensor, documents: Offsets | PackedDocuments, shard: EncoderShard | None = None
    ) -> torch.Tensor:
        """Packed documents x [T, dim] -> [T, dim]. With `shard`, x is this member's chunk of one document
        (`documents` is [0, len(x)]) and the attention over the whole document runs through the shard."""
        shape = (x.shape[0], self.n_heads, self.head_dim)
        q, k, v = self.wq(x).view(shape), self.wk(x).view(shape), self.wv(x).view(shape)
        if shard is None:
            out = self.attention(q, k, v, documents, causal=False)
        elif len(offsets := PackedDocuments.of(documents).offsets) != 2:
            raise ValueError(f"a sequence shard holds a chunk of one document, got cu_seqlens {list(offsets)}")
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

    def forward(
        self, x: torch.Tensor, documents: Offsets | PackedDocuments, shard: EncoderShard | None = None
    ) -> torch.Tensor:
        """Only attention mixes tokens, so under a `shard` (see EncoderAttention) the rest runs on the chunk as is."""
        x = x + self.attention(self.attention_norm(x), documents, shard)
        return x + self.mlp(self.mlp_norm(x))
