"""Architecture hyper-parameters. Plain frozen dataclasses, so a flavor is data that the estimator can read
without building a model, and the registry entries cannot be mutated by accident."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, get_args

from omni_core.common.plan import ModelShape
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
    shared_hidden: int | None = None  # the shared expert's width (None: the routed experts' ffn_hidden)
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output scaled by sigmoid(w x), one weight row
    renormalize: bool = True  # the k chosen probabilities rescaled to sum 1 (Mixtral; Qwen2-MoE's norm_topk_prob)
    aux_loss_coef: float = 0.01  # Switch-Transformer load-balancing loss weight

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoEArgs: top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")


RopeKind = Literal["linear", "llama3", "yarn"]


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequencies stretched for long contexts, by the rules transformers names `rope_type` (its
    `modeling_rope_utils`): `linear` divides every frequency by `factor`; `llama3` divides the low ones by
    `factor`, keeps the high ones and blends between `low_freq_factor` and `high_freq_factor`; `yarn` blends
    interpolated and extrapolated frequencies over a ramp set by `beta_fast` / `beta_slow` and scales cos/sin
    by `attention_factor` (derived from `factor` when None). `original_max_positions` is the pre-training
    context the last two measure against."""

    kind: RopeKind
    factor: float
    original_max_positions: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"RopeScaling: factor {self.factor} must be > 0")
        if self.kind in ("llama3", "yarn") and not self.original_max_positions:
            raise ValueError(f"RopeScaling: {self.kind} needs original_max_positions")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("RopeScaling: llama3 needs high_freq_factor > low_freq_factor")


# sdpa: one SDPA call per packed document (runs everywhere); flex: flex_attention with a block-sparse mask (no
# backward on CPU); varlen: FlashAttention over all documents in one call (torch.nn.attention.varlen, CUDA, bf16
# or fp16); auto: varlen where it runs, else sdpa. benchmarks/attention_timings.py times them.
AttentionKind = Literal["auto", "sdpa", "flex", "varlen"]
ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKind)


def attention_problem(
    kind: str,
    device: str,
    dtype: str,
    varlen: VarlenSupport | None,
    head_dims: Iterable[int] = (),
    window: bool = False,
) -> str | None:
    """Why attention `kind` cannot train on `device` ("cuda", "cpu") in `dtype` ("float32", "bfloat16", ...)
    for heads of `head_dims` (with a sliding window: `window`), or None. `varlen`: what this torch's varlen_attn
    takes (None: it has none). Torch-free, so that `omni recipe check` asks the rule the model applies at its
    first forward without loading torch; `auto` takes varlen wherever this finds no problem with it."""
    if kind not in ATTENTION_KINDS:
        return f"attention {kind!r} must be one of {', '.join(ATTENTION_KINDS)}"
    if kind == "flex" and device != "cuda":
        return f"flex_attention has no backward on {device}: training there needs sdpa (or auto)"
    if kind != "varlen":
        return None
    if device != "cuda":
        return f"varlen (FlashAttention) runs on CUDA GPUs only, not on {device}: use sdpa (or auto)"
    if varlen is None:
        return "this torch has no torch.nn.attention.varlen.varlen_attn (torch >= 2.9): use sdpa (or auto)"
    if dtype not in ("bfloat16", "float16"):
        return f"varlen (FlashAttention) computes in bfloat16 or float16, not {dtype}: set train.dtype bfloat16"
    unfit = sorted({d for d in head_dims if d % 8 or d > 256})
    if unfit:
        return f"varlen (FlashAttention) takes head dims that are multiples of 8 up to 256, not {unfit}"
    if window and not varlen.windows:
        return "this torch's varlen_attn has no window_size (torch >= 2.10) for the sliding window"
    return None


@dataclass(frozen=True)
class VarlenSupport:
    """What the installed `torch.nn.attention.varlen.varlen_attn` takes: `window_size` (sliding windows, torch
    >= 2.10) and `enable_gqa` (fewer KV heads than query heads, later; without it KV heads are repeated)."""

    windows: bool
    gqa: bool


ProjectorKind = Literal["mlp", "linear"]
PROJECTOR_KINDS: tuple[str, ...] = get_args(ProjectorKind)

# The FFN's gate activation (SwiGLU is silu); names as torch's, transformers' `gelu_pytorch_tanh` is gelu_tanh.
Activation = Literal["silu", "gelu", "gelu_tanh", "relu"]
# The encoders' MLP activation (SigLIP uses the tanh approximation).
EncoderActivation = Literal["gelu", "gelu_tanh", "relu"]


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
    rope_scaling: RopeScaling | None = None
    activation: Activation = "silu"
    tied_embeddings: bool = False  # the output head is the token embedding (Qwen2-0.5B, Llama-3.2-1B)
    # Mistral / Qwen2: a query sees at most the `sliding_window` latest keys of its document, in the layers from
    # `full_attention_layers` on (Qwen2's max_window_layers; the layers below it attend to the whole document)
    sliding_window: int | None = None
    full_attention_layers: int = 0
    # How attention runs over the packed documents (`models.attention.varlen_attention`; the recipe's
    # model.attention sets it for the whole model): auto picks varlen where it runs, else sdpa.
    attention: AttentionKind = "auto"
    moe: MoEArgs | None = None

    def __post_init__(self) -> None:
        _check_heads("LLMArgs", self.dim, self.n_heads, self.n_kv_heads)
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"LLMArgs: head_dim {self.dim // self.n_heads} must be even for RoPE")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"LLMArgs: sliding_window {self.sliding_window} must be >= 1 (None: no window)")

    def shape(self, seq_len: int | None = None) -> ModelShape:
        """What a parallel plan must divide or keep together (`ParallelPlan.check_model`)."""
        return ModelShape(
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            num_experts=self.moe.num_experts if self.moe else 0,
            seq_len=seq_len,
            tied_embeddings=self.tied_embeddings,
            sliding_window=self.sliding_window is not None and self.full_attention_layers < self.n_layers,
        )

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None where it attends to whole documents."""
        return self.sliding_window if layer >= self.full_attention_layers else None


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
    activation: EncoderActivation = "gelu"
    norm_eps: float = 1e-5
    # The features the projector reads pass the tower's final LayerNorm (SigLIP's post_layernorm); False: the
    # last block's output, LLaVA's hidden_states[-1] (what `omni export` can express).
    final_norm: bool = True

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
    activation: EncoderActivation = "gelu"
    # Neighbouring subsampled frames averaged after the blocks, before the final norm (Qwen2-Audio's avg_pooler:
    # 2): the LLM gets `batch.audio_tokens(frames, pool)` embeddings per clip; 1: none (Whisper's encoder)
    pool: int = 1

    def __post_init__(self) -> None:
        _check_heads("AudioArgs", self.dim, self.n_heads)
        if self.pool < 1:
            raise ValueError(f"AudioArgs: pool {self.pool} must be >= 1")


@dataclass(frozen=True)
class OmniModelArgs:
    llm: LLMArgs = field(default_factory=LLMArgs)
    vision: VisionArgs = field(default_factory=VisionArgs)
    audio: AudioArgs = field(default_factory=AudioArgs)
    projector_mult: int = 1  # projector hidden width = projector_mult * llm.dim
    spatial_merge: int = 1  # image projector input: s x s neighbouring patches concatenated (s*s fewer tokens)
    temporal_merge: int = 2  # video: consecutive frames averaged into one (after the vision encoder)
    # The audio projector: omni's two-layer GELU MLP, or one Linear from the encoder's width to the LLM's
    # (Qwen2-Audio's multi_modal_projector)
    audio_projector: ProjectorKind = "mlp"

    def attention_problem(self, kind: str, device: str, dtype: str, varlen: VarlenSupport | None) -> str | None:
        """`attention_problem` for every attention of the model: the LLM's and the encoders'."""
        llm = self.llm
        head_dims = (
            llm.dim // llm.n_heads,
            self.vision.dim // self.vision.n_heads,
            self.audio.dim // self.audio.n_heads,
        )
        return attention_problem(kind, device, dtype, varlen, head_dims, window=llm.shape().sliding_window)
