"""Architecture hyper-parameters. Plain frozen dataclasses, so a flavor is data that the estimator can read
without building a model, and the registry entries cannot be mutated by accident."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omni_core.common.tokenizer import VOCAB_SIZE


def _check_heads(name: str, dim: int, n_heads: int, n_kv_heads: int | None = None) -> None:
    if dim % n_heads:
        raise ValueError(f"{name}: dim {dim} is not divisible by n_heads {n_heads}")
    if n_kv_heads is not None and n_heads % n_kv_heads:
        raise ValueError(f"{name}: n_heads {n_heads} is not divisible by n_kv_heads {n_kv_heads}")


@dataclass(frozen=True)
class MoEArgs:
    """Mixture-of-experts FFN: every token goes to its `top_k` experts (no capacity limit, no token dropping)."""

    num_experts: int = 4
    top_k: int = 2
    shared_expert: bool = False  # an always-on dense expert next to the routed ones (DeepSeek/Qwen-MoE style)
    aux_loss_coef: float = 0.01  # Switch-Transformer load-balancing loss weight

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoEArgs: top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")


@dataclass(frozen=True)
class LLMArgs:
    vocab_size: int = VOCAB_SIZE
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 384  # per expert when `moe` is set
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2: biases on the q/k/v projections; Llama: none
    # sdpa: one SDPA call per packed document. flex: flex_attention with a block-sparse document mask, for GPUs
    # (benchmarks/attention_timings.py compares them); it has no backward on CPU.
    attention: Literal["sdpa", "flex"] = "sdpa"
    moe: MoEArgs | None = None

    def __post_init__(self) -> None:
        _check_heads("LLMArgs", self.dim, self.n_heads, self.n_kv_heads)
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"LLMArgs: head_dim {self.dim // self.n_heads} must be even for RoPE")


@dataclass(frozen=True)
class VisionArgs:
    patch_dim: int = 3 * 8 * 8  # 3 * patch * patch, set from the recipe's patch_size by get_flavor
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: float = 4.0
    # factorized: learned row + col tables, any grid up to max_grid x max_grid as is.
    # absolute: one learned table for a max_grid x max_grid grid (SigLIP/CLIP), resampled to other grids.
    pos_embed: Literal["factorized", "absolute"] = "factorized"
    max_grid: int = 64
    activation: Literal["gelu", "gelu_tanh"] = "gelu"  # SigLIP uses the tanh approximation
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        _check_heads("VisionArgs", self.dim, self.n_heads)


@dataclass(frozen=True)
class AudioArgs:
    n_mels: int = 32  # set from the recipe by get_flavor
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: float = 4.0
    max_frames: int = 3000  # longest clip accepted (log-mel frames, before the 2x subsampling)
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        _check_heads("AudioArgs", self.dim, self.n_heads)


@dataclass(frozen=True)
class OmniModelArgs:
    llm: LLMArgs = field(default_factory=LLMArgs)
    vision: VisionArgs = field(default_factory=VisionArgs)
    audio: AudioArgs = field(default_factory=AudioArgs)
    projector_mult: int = 1  # projector hidden width = projector_mult * llm.dim
    spatial_merge: int = 1  # image projector input: s x s neighbouring patches concatenated (s*s fewer tokens)
    temporal_merge: int = 2  # video: consecutive frames averaged into one (after the vision encoder)
