"""What the cost model prices: a job as lists of `Layer`s with per-sample costs, built from a shape.

A `Workload` is the LLM part (split into pipeline stages) and, for MLLMs, the encoder part (ViT, audio
encoder and projectors, placed by the layout). Every per-layer number is per *sample* (one packed sequence
for LLMs, one image for CNNs) so that a plan's micro-batch cost is a multiplication, and prefix sums over
layers make any stage's cost O(1): that is what keeps plan evaluation fast.

The builders, one module per family: `transformer_layers` (a transformer block, embedding, LM head, ViT,
projector), `lm_workloads.transformer` (dense GPT/Llama and GShard-style MoE), `cnn_workloads.wide_resnet`
(Alpa's Wide-ResNet), `omni_workloads.omni_workload` (an `OmniModelArgs` flavor, with document lengths from a
`DatasetProfile`), `trace_workloads.trace_workload` (Crius trace names such as `bert__1.3B`, `moe__10B`,
`wide_resnet__2B`) and `paper_workloads.paper_workload` (MegaScale-Omni's A-D at an image:text mix).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from omni_core.common.plan import ModelShape

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4}  # tf32: fp32 tensors, matmuls on TF32 tensor cores
# Optimizer states per parameter (fp32), beside the weights, their gradients and (for 2-byte weights) an fp32
# master copy; and the bytes its update streams per parameter relative to AdamW's (`Efficiency.
# optimizer_bytes_per_param` is AdamW's): AdamW reads p, g, m, v and writes p, m, v; SGD with momentum reads
# p, g, m and writes p, m; Adafactor (optax's default: no momentum, factored second moments of rows and
# columns) reads p, g and writes p.
OPTIMIZERS = {"adamw": (8.0, 1.0), "sgd": (4.0, 5 / 7), "adafactor": (0.0, 3 / 7)}


@dataclass(frozen=True)
class Layer:
    """One layer's costs per sample (forward). Backward is priced as 2x forward FLOPs by the cost model.

    Host costs are counted as the runtime's eager PyTorch runs them: `ops` aten operators per micro-batch and
    `sample_ops` per sample, forward + backward together (counted once from the model code with a dispatch
    counter, see the builders), and `attn_calls` attention calls per sample, one per packed document."""

    name: str
    params: float
    flops: float  # weight matmul / conv FLOPs
    attn_flops: float = 0.0  # attention scores and context (QK^T, AV): no weights, quadratic in document length
    attn_scores: float = 0.0  # elements of the full score matrices (heads x sum of squared document lengths)
    causal: bool = False  # causal attention: attn_flops count the visible half, a flash kernel skips the rest
    mm_bytes: float = 0.0  # matmul inputs and outputs: small matmuls are bound by their operands, not FLOPs
    mm_weight_bytes: float = 0.0  # matmul weights, read once per micro-batch
    act_bytes: float = 0.0  # activations kept for backward without checkpointing
    out_bytes: float = 0.0  # the output: what checkpointing keeps and what a pipeline stage sends on
    # op-level selective checkpointing (`selective_matmuls`): what it keeps beyond the output, and the FLOPs of
    # the matmuls it recomputes
    sac_bytes: float = 0.0
    sac_flops: float = 0.0
    mem_bytes: float = 0.0  # memory-bound traffic (norms, activation functions, residuals, softmax)
    # the buffers of TP's collectives per forward (each all-gather's output, each reduce-scatter's input);
    # backward mirrors every one of them (an all-gather's gradient is a reduce-scatter, and back)
    tp_bytes: float = 0.0
    a2a_bytes: float = 0.0  # bytes dispatched to experts per forward all-to-all (dispatch + combine = 2)
    expert_params: float = 0.0  # of `params`, those sharded by expert parallelism
    ops: float = 0.0  # aten operators per micro-batch, forward + backward (launch or dispatch overhead)
    sample_ops: float = 0.0  # the same per sample (per image, per clip)
    attn_calls: float = 0.0  # attention calls per sample (one per packed document on the CPU runtime)
    tensors: float = 0.0  # parameter tensors (the optimizer and the gradient norm pay per tensor)
    units: float = 0.0  # FSDP units it forms (a block; an encoder's remaining modules); the rest is the root's
    tp_colls: float = 0.0  # TP collectives per forward, each mirrored in backward
    tp_modules: float = 0.0  # modules TP parallelizes (each redistributes DTensors in forward and backward)
    expert_ops: float = 0.0  # of `ops`, those of the routed experts' loop (a rank runs E / ep experts)
    expert_tensors: float = 0.0  # of `tensors`, the routed experts' (sharded by EP)
    expert_flops: float = 0.0  # of `flops`, the router's and the experts' (the runtime does not split them by TP)


@dataclass(frozen=True)
class EncoderItems:
    """The encoder items (images, clips) as the `omni` layout balances and splits them, described by the
    encoder whose longest item is the longest (`encoder`: its `EncoderSpec` lays that item out).

    An item of x times `tokens` (the mean length, in the tokens an LSSP threshold counts: patches, mel frames)
    costs `work` x ((1 - quad) x + quad x^2) mean samples of encoder work: linear layers and attention's
    quadratic share (`encoders.item_length` inverts it)."""

    encoder: str = "vision"  # "vision" or "audio": a key of `EncoderPlan`
    count: float = 0.0  # that encoder's items per sample
    tokens: float = 0.0  # their mean length
    heads: int = 1  # that encoder's attention heads (an LSSP group splits them)
    quad: float = 0.0  # attention's share of the encoders' work at the mean length
    work: float = 0.0  # a mean item's encoder work, in mean samples'
    input_bytes: float = 0.0  # raw inputs per sample (fp32 patches, mel frames): what the data shard ships
    # (length in mean items, share) of that encoder's items, from the profile's histogram: how long a step's
    # longest item runs (`encoders.step_long_item_seconds`); empty: every step holds the workload's longest
    lengths: tuple[tuple[float, float], ...] = ()


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
    loader_imbalance: float = 0.0  # 0: not simulated (an image count's spread, `encoder_cv`); else the max /
    # mean of a rank's whole work (encoders + LLM) the loaders leave: the profile's simulated figure under
    # data.balance, `none` included, or a drawn step's (`dynamic.in_order_imbalance`)
    encoder_imbalance: float = 0.0  # 0: disaggregated encoder ranks priced unbalanced (`encoder_cv`); else the
    # max / mean per-encoder-rank work a step's assignment leaves (a drawn step, `estimator.dynamic`)
    encoder_max_item: float = 0.0  # encoder work of the longest single item (image, clip), in mean samples' work
    items: EncoderItems = EncoderItems()
    head_dim: int = 0  # the LLM's (ring attention's tiles)
    doc_span: float = 0.0  # E[L^2] / E[L] of the LLM's documents: the length of the one a random token is in
    optimizer: str = "adamw"  # a key of OPTIMIZERS: its states are part of the job's memory and its step
    # "": gradients as the runtime keeps and reduces them (`Efficiency.grad_bytes`, fp32); else a key of BYTES:
    # the job's own, e.g. "fp16" for Alpa's jobs, which differentiate their fp16 weights (`trace_workloads`)
    grad_precision: str = ""
    recompute: bool | None = None  # activation recomputation the job fixes (True / False); None: searched
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # stage partitions and sums by pp

    def __post_init__(self) -> None:
        if self.grad_precision and self.grad_precision not in BYTES:
            raise ValueError(f"{self.name}: grad_precision={self.grad_precision!r}; known: {', '.join(BYTES)}")

    @property
    def cost_prefix(self) -> tuple[float, ...]:
        """Running FLOPs (weights + attention) over the LLM layers: what the stage partition balances."""
        prefix = self.cache.get("cost_prefix")
        if prefix is None:
            prefix = self.cache["cost_prefix"] = tuple(
                itertools.accumulate((layer.flops + layer.attn_flops for layer in self.llm), initial=0.0)
            )
        return prefix

    @property
    def params(self) -> float:
        return sum(layer.params for layer in self.llm + self.encoder)

    @property
    def is_moe(self) -> bool:
        return self.shape.num_experts > 0


def quadratic_share(encoder: list[Layer] | tuple[Layer, ...]) -> float:
    """Attention's share of the encoders' forward FLOPs: the part of an item's work quadratic in its length."""
    return sum(layer.attn_flops for layer in encoder) / max(
        sum(layer.flops + layer.attn_flops for layer in encoder), 1.0
    )
