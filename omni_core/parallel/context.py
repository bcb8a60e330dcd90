"""Context parallelism (CP) for the LLM's packed-sequence attention: each of `cp` ranks holds T/cp tokens.

PyTorch's `context_parallel` registers ring attention only for the GPU SDPA kernels (PLATFORM-NOTES.md), so
both layouts are built here from collectives and plain tensor ops, and run the same on gloo and nccl:

- Ulysses: two all-to-alls swap "local tokens x all heads" for "all tokens x H/cp heads", so the unchanged
  `varlen_attention` runs on whole documents. Needs H divisible by cp; communication is O(T/cp) per rank.
- Ring: queries stay put and key/value blocks travel around the ring; per-block results are merged by
  log-sum-exp. Any head count works; tokens are laid out zig-zag so causal work is balanced.

`ContextParallelAttention` has the signature of `varlen_attention`, so the model installs it as
`Attention.attend` and slices its embeddings, positions and labels by `cp_token_index`. Ring tiles compute in the
inputs' dtype (bf16 under autocast); softmax statistics and the output and gradient accumulators stay float32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from omni_core.models.attention import varlen_attention
from omni_core.models.documents import Offsets, PackedDocuments, document_ids, host_to_device

KINDS = ("ulysses", "ring")


def cp_token_index(total: int, cp: int, rank: int, kind: str) -> torch.Tensor:
    """Global indices (long [total // cp]) of the packed tokens that `rank` holds.

    Ulysses holds contiguous chunk `rank`. Ring cuts the sequence into 2*cp chunks and holds chunks `rank` and
    `2*cp-1-rank`: under a causal mask late chunks see more keys than early ones, and pairing them gives every
    rank the same work.
    """
    if kind not in KINDS:
        raise ValueError(f"context parallel kind must be one of {KINDS}, got {kind!r}")
    n_chunks = cp if kind == "ulysses" else 2 * cp
    if total % n_chunks:
        raise ValueError(
            f"{kind} context parallelism over {cp} ranks needs tokens divisible by {n_chunks}, got {total}"
        )
    chunk = total // n_chunks
    chunks = [rank] if kind == "ulysses" else [rank, n_chunks - 1 - rank]
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks])


def ulysses_kv_repeats(n_heads: int, n_kv_heads: int, cp: int) -> int:
    """How many times Ulysses repeats each KV head so that KV heads, like query heads, split evenly over cp ranks.

    Repeating to lcm(Hkv, cp) heads keeps grouped-query pairing (query head h uses KV head h // (H / Hkv)) and
    sends the fewest KV heads. Exposed so that plan validation can reject a layout before launching.
    """
    if n_heads % cp:
        raise ValueError(
            f"Ulysses context parallelism splits heads over ranks: {n_heads} heads do not divide by "
            f"cp={cp}; use ring attention or another cp degree"
        )
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads")
    return math.lcm(n_kv_heads, cp) // n_kv_heads


class ContextParallelAttention:
    """Drop-in for `varlen_attention` (same call) when this rank holds only its `cp_token_index` tokens.

    q [T/cp, H, D], k/v [T/cp, Hkv, D] are this rank's tokens in `cp_token_index` order; `cu_seqlens` are the
    GLOBAL document offsets of all `total_tokens`. Returns this rank's output [T/cp, H, D]. Every rank of
    `group` must call it in the same order (it communicates in forward and backward). `block_size` bounds the
    ring's query/key tiles: memory per tile is H x block_size^2 floats, and tiles without a visible pair
    (other documents, the causal future) are skipped.
    """

    def __init__(self, kind: str, group: dist.ProcessGroup, total_tokens: int, *, block_size: int = 1024):
        self.kind = kind
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.total_tokens = total_tokens
        self.block_size = block_size
        cp_token_index(total_tokens, self.cp, self.rank, kind)  # validates kind and divisibility

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: Offsets | PackedDocuments,
        causal: bool,
        window: int | None = None,
        kind: str = "auto",
    ) -> torch.Tensor:
        if q.shape[0] * self.cp != self.total_tokens:
            raise ValueError(
                f"expected {self.total_tokens // self.cp} local tokens on each of {self.cp} ranks, got {q.shape[0]}"
            )
        docs = PackedDocuments.of(documents)
        if self.kind == "ulysses":
            return self._ulysses(q, k, v, docs, causal, window, kind)
        if window is not None:
            raise ValueError("ring attention has no sliding window (ParallelPlan.check_model refuses the plan)")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
        schedule, lo, hi = _ring_layout(
            docs.offsets, docs.padding, self.total_tokens, causal, self.cp, self.rank, self.block_size, q.device
        )
        return _RingAttention.apply(q, k, v, schedule, lo, hi, self.group)

    def _ulysses(self, q, k, v, docs, causal, window, kind):
        repeats = ulysses_kv_repeats(q.shape[1], k.shape[1], self.cp)
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        # [T/cp, heads, D] -> [T, heads/cp, D]: scatter heads, gather tokens (rank order = token order).
        q, k, v = (_AllToAll.apply(x, self.group, 1, 0) for x in (q, k, v))
        out = varlen_attention(q, k, v, docs, causal, window, kind)
        return _AllToAll.apply(out, self.group, 0, 1)


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `scatter_dim` into cp pieces, send piece j to rank j, concatenate the pieces received along
    `gather_dim` in rank order."""
    cp = dist.get_world_size(group)
    send = torch.stack(x.chunk(cp, dim=scatter_dim))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` whose gradient is the reverse all-to-all (gather and scatter dimensions swapped)."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


# --- Ring attention -------------------------------------------------------------------------------------------
#
# Every query i may see the keys of one global interval [lo_i, hi_i): its document, cut at i + 1 when causal.
# The host plans, from the document offsets, which (query tile, key tile) pairs hold a visible pair and which
# are entirely visible (no mask needed); the device builds each tile's mask from lo/hi.


def _tiles(total: int, cp: int, rank: int, block_size: int) -> list[tuple[int, int, int]]:
    """(local start, local end, global start) of a rank's ring tokens, each of its two chunks cut into tiles."""
    chunk = total // (2 * cp)
    tiles = []
    for position, global_chunk in enumerate((rank, 2 * cp - 1 - rank)):
        for start in range(0, chunk, block_size):
            end = min(start + block_size, chunk)
            tiles.append((position * chunk + start, position * chunk + end, global_chunk * chunk + start))
    return tiles


@functools.lru_cache(maxsize=8)
def _ring_layout(
    offsets: tuple[int, ...],
    padding: frozenset[int],
    total: int,
    causal: bool,
    cp: int,
    rank: int,
    block_size: int,
    device: torch.device,
):
    """(schedule, lo, hi): schedule[src] lists the tiles (q0, q1, k0, k1, key global start, fully visible) of
    local queries against source rank src's keys; lo/hi [T/cp] bound each local query's visible keys (none for
    a padding document's query: its output is 0). Cached: every layer, forward and backward, reuses one layout."""
    if offsets[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to the {total} tokens, got {list(offsets)}")
    index = cp_token_index(total, cp, rank, "ring")
    doc = document_ids(offsets)[index]
    bounds = torch.tensor(offsets)
    lo = bounds[doc]
    hi = index + 1 if causal else bounds[doc + 1]
    if padding:
        hi = torch.where(torch.isin(doc, torch.tensor(sorted(padding))), lo, hi)
    schedule = []
    for src in range(cp):
        tiles = []
        for q0, q1, _ in _tiles(total, cp, rank, block_size):
            for k0, k1, g0 in _tiles(total, cp, src, block_size):
                g1 = g0 + k1 - k0
                tile_lo, tile_hi = lo[q0:q1], hi[q0:q1]
                if (tile_lo.clamp(min=g0) < tile_hi.clamp(max=g1)).any():
                    full = bool(((tile_lo <= g0) & (tile_hi >= g1)).all())
                    tiles.append((q0, q1, k0, k1, g0, full))
        schedule.append(tuple(tiles))
    return tuple(schedule), host_to_device(lo, device), host_to_device(hi, device)


def _ring_shift(tensor: torch.Tensor, group) -> Callable[[], torch.Tensor]:
    """Start sending `tensor` to the next rank and receiving the previous rank's; returns a wait() giving it."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if cp == 1:
        return lambda: tensor
    recv = torch.empty_like(tensor)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, tensor, group=group, group_peer=(rank + 1) % cp),
            dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % cp),
        ]
    )

    def wait() -> torch.Tensor:
        for work in works:
            work.wait()
        return recv

    return wait


def _tile_scores(q, k, lo, hi, tile, scale):
    """Scaled scores [Hkv, rep, q tile, k tile]: the product in the inputs' dtype, then float32 (softmax's
    exponent), -inf where the key is not visible."""
    q0, q1, k0, k1, g0, full = tile
    scores = (q[:, :, q0:q1] @ k[:, None, k0:k1].transpose(-1, -2)).float() * scale
    if full:
        return scores
    keys = torch.arange(g0, g0 + k1 - k0, device=scores.device)
    visible = (keys >= lo[q0:q1, None]) & (keys < hi[q0:q1, None])
    return scores.masked_fill(~visible, float("-inf"))


def _grouped(x: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """[T, H, D] -> [Hkv, H/Hkv, T, D]: query heads grouped under the KV head they share."""
    tokens, heads, dim = x.shape
    return x.transpose(0, 1).reshape(n_kv_heads, heads // n_kv_heads, tokens, dim)


def _ungrouped(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `_grouped`: [Hkv, H/Hkv, T, D] -> [T, H, D] in `dtype`."""
    kv_heads, rep, tokens, dim = x.shape
    return x.reshape(kv_heads * rep, tokens, dim).transpose(0, 1).to(dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention with a flash-attention-style backward.

    The forward keeps the global log-sum-exp of each query; the backward recomputes each tile's probabilities
    from it (softmax over all blocks without storing them) and sends dK/dV accumulators around the ring with
    the K/V blocks, so that after cp steps each accumulator is back on the rank that owns those keys. As in
    FlashAttention, matrix products take the inputs' dtype (probabilities cast to it), while scores, softmax
    statistics and accumulators are float32; autocast is off inside, so the dtypes are these whatever it says.
    """

    @staticmethod
    def forward(ctx, q, k, v, schedule, lo, hi, group):
        with torch.autocast(q.device.type, enabled=False):
            result, lse = _ring_forward(q, k, v, schedule, lo, hi, group)
        ctx.save_for_backward(q, k, v, result, lse, lo, hi)
        ctx.schedule, ctx.group = schedule, group
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, lo, hi = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _ring_backward(q, k, v, out, lse, lo, hi, grad_out, ctx.schedule, ctx.group)
        return dq, dk, dv, None, None, None, None


def _ring_forward(q, k, v, schedule, lo, hi, group) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's output [T/cp, H, D] (q's dtype) and the float32 log-sum-exp [Hkv, H/Hkv, T/cp] of its queries."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    n_kv_heads, scale = k.shape[1], q.shape[-1] ** -0.5
    q4 = _grouped(q, n_kv_heads)
    out = torch.zeros(q4.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q4.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    for step in range(cp):
        pending = _ring_shift(kv, group) if step < cp - 1 else None
        kb, vb = (x.transpose(0, 1) for x in kv)
        for tile in schedule[(rank - step) % cp]:
            q0, q1, k0, k1 = tile[:4]
            scores = _tile_scores(q4, kb, lo, hi, tile, scale)
            tile_lse = scores.logsumexp(-1)  # -inf for a query with no visible key in this tile
            probs = torch.exp(scores - tile_lse.nan_to_num(neginf=0.0)[..., None])
            tile_out = (probs.to(v.dtype) @ vb[:, None, k0:k1]).float()
            old_lse = lse[..., q0:q1]
            new_lse = torch.logaddexp(old_lse, tile_lse)
            finite = new_lse.nan_to_num(neginf=0.0)
            out[..., q0:q1, :] = (
                out[..., q0:q1, :] * torch.exp(old_lse - finite)[..., None]
                + tile_out * torch.exp(tile_lse - finite)[..., None]
            )
            lse[..., q0:q1] = new_lse
        if pending is not None:
            kv = pending()
    return _ungrouped(out, q.dtype), lse


def _ring_backward(q, k, v, out, lse, lo, hi, grad_out, schedule, group):
    """dq, dk, dv (the inputs' dtypes) of `_ring_forward`, accumulated in float32."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    n_kv_heads, scale = k.shape[1], q.shape[-1] ** -0.5
    q4, do4 = _grouped(q, n_kv_heads), _grouped(grad_out.to(q.dtype), n_kv_heads)
    delta = (do4.float() * _grouped(out, n_kv_heads).float()).sum(-1)  # rowsum(dO * O) = sum_j P_ij dP_ij
    dq4 = torch.zeros(q4.shape, dtype=torch.float32, device=q.device)
    lse = lse.nan_to_num(neginf=0.0)  # a query seeing no key (padding): its scores are all -inf, its probs 0
    kv = torch.stack([k, v])
    # dK, dV of the block held now: they travel with it.
    dkv = torch.zeros(2, n_kv_heads, k.shape[0], k.shape[2], dtype=torch.float32, device=k.device)
    for step in range(cp):
        pending = _ring_shift(kv, group) if step < cp - 1 else None
        kb, vb = (x.transpose(0, 1) for x in kv)
        for tile in schedule[(rank - step) % cp]:
            q0, q1, k0, k1 = tile[:4]
            probs = torch.exp(_tile_scores(q4, kb, lo, hi, tile, scale) - lse[..., q0:q1, None])
            tile_do = do4[:, :, q0:q1]
            dkv[1, :, k0:k1] += (probs.to(q.dtype).transpose(-1, -2) @ tile_do).float().sum(1)
            dprobs = (tile_do @ vb[:, None, k0:k1].transpose(-1, -2)).float()
            dscores = (probs * (dprobs - delta[..., q0:q1, None])).to(q.dtype)
            dq4[:, :, q0:q1] += (dscores @ kb[:, None, k0:k1]).float() * scale
            dkv[0, :, k0:k1] += (dscores.transpose(-1, -2) @ q4[:, :, q0:q1]).float().sum(1) * scale
        dkv = _ring_shift(dkv, group)()  # after cp shifts the accumulators are home
        if pending is not None:
            kv = pending()
    dk, dv = (x.transpose(0, 1).to(k.dtype) for x in dkv)
    return _ungrouped(dq4, q.dtype), dk, dv
