"""The cost model's inputs, and what they imply for every term of one estimate.

`Efficiency` and `Options` are what a caller chooses (`cost` re-exports them: they are its public types);
`PlanTerms` derives once per estimate the rates, group sizes and passes that the stage, memory and encoder
terms all read. They live here, below those modules and below the entry point that composes them, so that
each part can read them without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from omni_core.common.catalog import GpuSpec
from omni_core.common.plan import ParallelPlan
from omni_core.estimator.communication import Network
from omni_core.estimator.workloads import BYTES, OPTIMIZERS, Workload


@dataclass(frozen=True)
class Efficiency:
    """Shares of the catalogue's peaks a training step reaches, overheads and overlap assumptions.

    Defaults are typical large-model GPU figures (Megatron-LM / torchtitan reach 40-60% MFU); the
    micro-profile (`calibrate.py`) replaces them with measured values for the device at hand."""

    matmul: float = 0.6  # of peak FLOP/s for weight matmuls / convolutions
    attention: float = 0.45  # of peak FLOP/s for attention (flash kernels)
    memory: float = 0.75  # of memory bandwidth for memory-bound ops
    link: float = 0.8  # of link bandwidth reached by collectives
    op_overhead_s: float = 1e-6  # per aten operator (forward or backward) not hidden by asynchronous launches
    attn_call_s: float = 0.0  # per attention call, forward + backward (the CPU runtime loops over documents)
    matmul_bw: float = 0.0  # bytes/s at which matmuls move their operands (0: memory bandwidth x `memory`)
    # bytes/s at which the runtime's element-wise operators (norms, RoPE, the gate's activation, residuals) get
    # through the bytes a layer's `mem_bytes` counts (0: memory bandwidth x `memory`). On a CPU they run from
    # cache but compute transcendentals and broadcasts element by element: slower than streaming
    elementwise_bw: float = 0.0
    score_s: float = 0.0  # seconds per attention score element (forward) beyond its FLOPs: softmax, masking
    attention_full: bool = False  # attention computes whole score matrices (no causal skipping): CPU SDPA
    step_overhead_s: float = 0.0  # host work per step not in the model (data loading, bookkeeping)
    optimizer_bytes_per_param: float = 36.0  # fused AdamW: read p, g, m, v (fp32), write p, m, v, bf16 copy
    # share of DP gradient traffic hidden behind backward (0: the CPU runtime's); at most the backward of the
    # step's last micro-batch, during which the gradients are reduced (`stage.price_stage`)
    dp_overlap: float = 0.8
    # How the runtime runs a ZeRO stage (`ParallelPlan.sharding`). Megatron-LM's distributed optimizer and
    # DeepSpeed's ZeRO keep whole compute-precision weights and shard the fp32 master copy with the optimizer
    # states, and reduce gradients in buckets during the backward (hidden like FSDP's: `dp_overlap`; ZeRO-2 then
    # never holds them whole). omni's runtime (`parallel.zero`) keeps fp32 parameters whole (autocast casts them)
    # and reduces once after the backward, exposed, ZeRO-2 freeing the whole gradients only then: both False.
    zero_master_sharded: bool = False
    zero_reduce_in_backward: bool = False
    # and all-gathers the updated parameters during the next step's forward (Megatron's --overlap-param-gather),
    # hidden like the reduction; omni's and DeepSpeed's all-gather after the step, exposed
    zero_gather_in_forward: bool = False
    tp_overlap: float = 0.0  # share of TP collectives hidden
    # the runtime decomposes TP's all-gathers and reduce-scatters into the matmuls they feed (Megatron-Core's
    # --tp-comm-overlap, torchtitan's async TP, on Hopper): their volume hides behind those matmuls, the excess
    # and every latency exposed (`stage.tp_seconds`). omni's runtime does not: exposed
    tp_async: bool = False
    ep_overlap: float = 0.0
    cp_overlap: float = 0.5  # ring CP: share of the K/V passing hidden behind block attention
    pp_overlap: float = 0.5  # share of pipeline sends hidden
    grad_bytes: float = 4.0  # fp32 gradient accumulation and reduction
    # memory-bound seconds x this when a node's ranks run at once on a CPU device (`GpuSpec.cores`): they share
    # its memory bandwidth (a GPU has its own); measured by the ranks probe
    shared_memory: float = 1.0
    # of a collective's wall seconds, the share its rank's process spends on a core (copies, polling); the rest
    # it waits, and ranks time-sharing fewer cores fill that wait with their own work (1: all of it on a core;
    # measured by the ranks probe)
    link_cpu_share: float = 1.0
    # a rank's own work (compute and operators, profiled on one rank alone) x this in a multi-rank step: ranks
    # jitter independently and every collective waits for the slowest (and wakes the waiting ones); 1 on a
    # device never probed, measured by the ranks probe (the wrappers' and links' probes include it)
    straggle: float = 1.0
    workspace_frac: float = 0.05  # of the activations: temporaries, allocator slack
    # per-kind (latency, bandwidth) multipliers of the link's all-reduce figures, e.g. gloo's all-to-all
    collectives: tuple[tuple[str, float, float], ...] = ()
    tensor_s: float = 0.0  # host seconds per plain parameter tensor per step (optimizer, gradient norm)
    dtensor_s: float = 0.0  # the same for a sharded (DTensor) parameter: FSDP or TP
    tensor_group_s: float = 0.0  # and per parameter group (the foreach AdamW's and the norm's calls), plain
    dtensor_group_s: float = 0.0  # or DTensor
    # the runtime's wrappers, per micro-batch, forward + backward: an FSDP unit (hooks, copies; its
    # collectives are priced by the links), a TP-parallel module (DTensor redistributions, with their
    # collectives' latency), a pipeline stage's schedule step (with its sends' latency)
    fsdp_unit_s: float = 1e-4
    fsdp_tensor_s: float = 0.0  # and per parameter tensor in a unit (copies in and out, gradient views)
    tp_module_s: float = 2e-5
    pp_microbatch_s: float = 1e-4
    # What the implementation splits: True (Megatron-style), encoders are split by TP x CP like the LLM and
    # MoE experts by TP; False (omni_core's runtime today), both run replicated on every TP (and CP) rank.
    split_encoders_experts: bool = True
    # `omni` layout under the joint encoder schedule (`EncoderPlan.schedule`): the share of the LLM pipeline's
    # bubbles the encoders' forward and backward fill (they then run per micro-batch). Not all of them: an
    # encoder forward must end before stage 0 needs its embeddings, so late stages' warm-up bubbles host
    # later micro-batches' encoders only (0.75 is a fair guess). The phased schedule fills none.
    joint_pipeline: float = 0.75
    # `disaggregated` layout under the joint schedule (DistTrain's): the share of the shorter side (encoder
    # ranks or LLM ranks) hidden behind the longer once the first micro-batch's encoders are done and until the
    # last one's backward (a step of m micro-batches hides at most (m - 1) / m of it). Phased hides none.
    disaggregated_overlap: float = 1.0


@dataclass(frozen=True)
class Options:
    """Choices the Cell search makes per plan besides the plan itself (whose `encoders` lay out the encoders)."""

    micro_batch: int = 1  # samples per micro-batch per DP rank
    checkpoint: bool = False  # activation checkpointing (recompute each layer in backward)
    # what checkpointing keeps, as torchtitan's selective checkpointing chooses: "" every block whole (the
    # runtime's), "layer" every second block, "op" the outputs of attention and of every other matmul
    # (`transformer_layers.selective_matmuls`). The search never picks a selective one: they price measurements
    # made with them (benchmarks/estimator_gpu_bench.py) and a recipe's `train.activation_checkpointing: selective`
    # ("op", the runtime's per-operator policy).
    selective: str = ""

    def __post_init__(self) -> None:
        if self.selective not in SELECTIVE or (self.selective and not self.checkpoint):
            raise ValueError(f"Options.selective={self.selective!r}: one of {SELECTIVE}, and only with checkpoint")


SELECTIVE = ("", "layer", "op")


def recompute_share(workload: Workload, options: Options) -> float:
    """Of a forward, the share checkpointing recomputes in backward: all of it; half under "layer"; under "op"
    the FLOPs of the matmuls it does not keep (element-wise operators recompute too, priced at that share).
    Selective checkpointing is modelled for dense transformer LLMs (the measurements it prices), and refused
    by name for anything else."""
    if not options.checkpoint:
        return 0.0
    if options.selective and (workload.encoder or workload.is_moe or not workload.head_dim):
        raise ValueError(
            f"{workload.name}: selective checkpointing ({options.selective!r}) is modelled for dense "
            "transformer LLMs only, not for encoders, MoE or convolutions"
        )
    if options.selective == "op":
        flops = sum(layer.flops + layer.attn_flops for layer in workload.llm)
        return sum(layer.sac_flops for layer in workload.llm) / flops
    return 0.5 if options.selective == "layer" else 1.0


def node_efficiency(eff: Efficiency, gpu: GpuSpec, plan: ParallelPlan, gpus_per_node: int) -> Efficiency:
    """`eff` as the plan's ranks see it: ranks of a CPU node (`GpuSpec.cores`) that stream at once share its
    memory bandwidth, so memory-bound work (not matmul operands, which stay in cache) slows down by
    `shared_memory`; a GPU has its own."""
    if gpu.cores and eff.shared_memory != 1.0 and min(plan.world_size, gpus_per_node, gpu.cores) > 1:
        return replace(
            eff,
            memory=eff.memory / eff.shared_memory,
            matmul_bw=eff.matmul_bw or gpu.mem_bw * eff.memory,
            elementwise_bw=eff.elementwise_bw / eff.shared_memory,
        )
    return eff


@dataclass(slots=True)
class PlanTerms:
    """One (workload, GPU, plan, options, efficiency) and the quantities every term of its estimate reads.
    Read-only by convention (not frozen: a frozen dataclass's construction costs ~10% of an estimate)."""

    workload: Workload
    gpu: GpuSpec
    plan: ParallelPlan
    options: Options
    eff: Efficiency  # `node_efficiency`: as the plan's ranks see it
    net: Network
    gpus_per_node: int
    micro_batches: int  # per step per pipeline (m)
    mm_rate: float  # FLOP/s of weight matmuls
    attn_rate: float  # FLOP/s of attention
    mem_rate: float  # bytes/s of memory-bound work
    split: int  # ranks one micro-batch's LLM work is spread over: tp x cp
    recompute: float  # of a forward, the share checkpointing recomputes in backward (`recompute_share`)
    passes: float  # forward, backward (2x), recomputed forward: in forward-pass units
    weight_bytes: int  # bytes per weight at the workload's precision
    state_bytes: float  # model-state bytes per parameter: weights, gradients, optimizer (+ fp32 master copy)
    master_bytes: float  # of them, the fp32 master copy's (2-byte weights only)
    optimizer_state_bytes: float  # of them, the optimizer's states'
    optimizer_traffic: float  # bytes the optimizer's update streams per parameter
    shards: int  # the shard group, dp_shard x cp: what the plan's sharding stage splits; dp_replicate copies
    fsdp: bool  # the runtime wraps every block in FSDP (HSDP) whenever there is more than one replica (FSDP stage)
    expert_shards: int  # the experts' own FSDP group: the ranks with the same EP index
    tokens: float  # packed tokens per micro-batch
    rank_span: int  # ranks of one FSDP group lie within this many consecutive ranks
    ep_split: int  # tokens an EP rank holds are its own: split over cp, or tp x cp when experts are split
    # a pipeline spanning nodes has a stage boundary across them (stages are the outermost mesh dimension),
    # which its slowest send rules; this many of a node's ranks send over it at once
    pipeline_senders_across: int  # 0: the pipeline stays in one node
    straggle: float  # a rank's own work x this in a multi-rank step (`Efficiency.straggle`)
    encoder_split: int  # `coupled`: ranks an encoder's work is split over, tp x cp, or 1 when they run replicated

    @classmethod
    def of(
        cls, workload: Workload, gpu: GpuSpec, plan: ParallelPlan, options: Options, eff: Efficiency, gpus_per_node: int
    ) -> PlanTerms:
        eff = node_efficiency(eff, gpu, plan, gpus_per_node)
        if workload.grad_precision:  # the job's gradients: its memory and its reductions' volume
            eff = replace(eff, grad_bytes=float(BYTES[workload.grad_precision]))
        peak = gpu.compute_flops(workload.precision)
        split = plan.tp * plan.cp
        recompute = recompute_share(workload, options)
        weight_bytes = BYTES[workload.precision]
        optimizer_states, traffic = OPTIMIZERS[workload.optimizer]
        shards = plan.dp_shard * plan.cp
        return cls(
            workload=workload,
            gpu=gpu,
            plan=plan,
            options=options,
            eff=eff,
            net=Network(gpu, gpus_per_node, eff.link, eff.collectives),
            gpus_per_node=gpus_per_node,
            micro_batches=workload.global_batch // (plan.dp * options.micro_batch),
            mm_rate=peak * eff.matmul,
            attn_rate=peak * eff.attention,
            mem_rate=gpu.mem_bw * eff.memory,
            split=split,
            recompute=recompute,
            passes=3.0 + recompute,
            weight_bytes=weight_bytes,
            state_bytes=weight_bytes + eff.grad_bytes + optimizer_states + (4.0 if weight_bytes == 2 else 0.0),
            master_bytes=4.0 if weight_bytes == 2 else 0.0,
            optimizer_state_bytes=optimizer_states,
            optimizer_traffic=eff.optimizer_bytes_per_param * traffic,
            shards=shards,
            fsdp=plan.dp * plan.cp > 1 and not plan.zero,
            expert_shards=max(1, shards // plan.ep),
            tokens=workload.tokens_per_sample * options.micro_batch,
            rank_span=split * plan.dp_shard,
            ep_split=split if eff.split_encoders_experts else plan.cp,
            pipeline_senders_across=(
                min(gpus_per_node, plan.world_size // plan.pp) if plan.world_size > gpus_per_node else 0
            ),
            straggle=eff.straggle if plan.world_size > 1 else 1.0,
            encoder_split=split if eff.split_encoders_experts else 1,
        )
