"""Decoder-only language models as workloads: GPT and Llama, dense or with mixture-of-experts FFNs (GShard's
dense dispatch as Alpa runs it, or the runtime's index-based routing), over packed sequences of documents."""

from __future__ import annotations

from dataclasses import replace

from omni_core.common.plan import ModelShape
from omni_core.estimator.transformer_layers import BlockArch, block_layer, embedding, lm_head
from omni_core.estimator.workloads import BYTES, OPTIMIZERS, Layer, Workload


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
    doc_len = min(doc_len or seq_len, seq_len)
    b = BYTES[precision]
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"{name}: optimizer={optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    arch = BlockArch(dim, heads, kv_heads, ffn or 4 * dim, gated, bias, experts, top_k, expert_group=expert_group)
    blocks = _decoder_blocks(arch, n_layers, moe_every, seq_len, doc_len, b)
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


def _decoder_blocks(
    arch: BlockArch, n_layers: int, moe_every: int, seq_len: int, doc_len: float, dtype_bytes: int
) -> list[Layer]:
    """The decoder's `n_layers` causal blocks over sequences of `seq_len` tokens in documents of `doc_len`:
    with experts, the mixture in every `moe_every`-th block from the first and dense FFNs between."""
    docs = seq_len / doc_len

    def layer(arch: BlockArch) -> Layer:
        return block_layer(
            "block", arch, tokens=seq_len, sum_sq=docs * doc_len**2, docs=docs, causal=True, dtype_bytes=dtype_bytes
        )

    block = layer(arch)
    dense = layer(replace(arch, experts=0, top_k=1, expert_group=0)) if arch.experts and moe_every > 1 else block
    return [block if i % moe_every == 0 else dense for i in range(n_layers)]
