"""Calibration probes made of the model's own transformer block: a tiny one, all operator overhead (what one
aten operator costs the host), and a Llama block's element-wise operators at a model's size (what the
element-wise work the cost model counts in `Layer.mem_bytes` runs at)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from omni_core.estimator.transformer_layers import transformer_block
from omni_core.measure.probe_device import ProbeDevice

if TYPE_CHECKING:
    import torch


def tiny_block(device: torch.device | None = None) -> Callable[[], None]:
    """Forward + backward of a tiny LLM block (4 tokens): nothing but operator overhead (on a GPU: launches)."""
    import torch

    from omni_core.models.args import LLMArgs
    from omni_core.models.llm import TransformerBlock, rope_cos_sin

    device = device or torch.device("cpu")
    args = LLMArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64, vocab_size=8)
    block, x = TransformerBlock(args).to(device), torch.randn(4, 32, device=device, requires_grad=True)
    cos, sin = (t.to(device) for t in rope_cos_sin(torch.arange(4), args))

    def tiny() -> None:
        block(x, cos, sin, [0, 4]).sum().backward()

    return tiny


def elementwise_block(at: ProbeDevice) -> Callable[[], None]:
    """Forward + backward of a Llama block's element-wise operators, as the model runs them, at
    `at.elementwise_block`'s size: its two RMSNorms and residual adds, RoPE on the queries and keys, and the
    SwiGLU gate (its matmuls and attention are the other probes')."""
    import torch

    from omni_core.models.args import LLMArgs
    from omni_core.models.llm import TransformerBlock, apply_rope, rope_cos_sin

    tokens, dim, heads, kv_heads, ffn = at.elementwise_block
    dev, dtype = torch.device(at.device), getattr(torch, at.dtype)
    args = LLMArgs(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, ffn_hidden=ffn, vocab_size=8)
    block = TransformerBlock(args).to(dev, dtype)
    head_dim = dim // heads
    act = block.feed_forward.act

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True)

    x, q, k, gate, up = (
        leaf(tokens, dim),
        leaf(tokens, heads, head_dim),
        leaf(tokens, kv_heads, head_dim),
        leaf(tokens, ffn),
        leaf(tokens, ffn),
    )
    cos, sin = (t.to(dev) for t in rope_cos_sin(torch.arange(tokens), args))

    def run() -> None:
        h = x + block.attention_norm(x)
        h = h + block.ffn_norm(h)
        gated = act(gate) * up
        (h.sum() + apply_rope(q, cos, sin).sum() + apply_rope(k, cos, sin).sum() + gated.sum()).backward()

    return run


def elementwise_bytes(at: ProbeDevice) -> float:
    """The forward bytes the cost model counts for the element-wise probe's work (`Layer.mem_bytes`)."""
    tokens, dim, heads, kv_heads, ffn = at.elementwise_block
    return transformer_block(
        "probe",
        dim=dim,
        heads=heads,
        kv_heads=kv_heads,
        ffn=ffn,
        tokens=tokens,
        sum_sq=0.0,
        docs=1,
        causal=True,
        gated=True,
        bias=False,
        dtype_bytes=int(at.element_bytes),
    ).mem_bytes
