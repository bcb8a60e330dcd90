"""The analytic cost model: one plan of one workload on one GPU type -> step time, memory, or the reason
it does not fit.

Time of one training step (per rank; the slowest pipeline stage rules):

    pipeline   1F1B / GPipe: (m - 1) * max_s(t_s) + sum_s(t_s)   (warm-up + steady state + cool-down);
               interleaved: (m + (pp - 1) / v) * max_s(t_s); no pipeline: m * t_0
    t_s        one micro-batch forward + backward on stage s (backward = 2x forward FLOPs, + 1x recomputing):
               FLOPs / (peak * efficiency) + memory-bound bytes / bandwidth       (the device)
               + aten operators x per-operator cost + documents x per-attention-call cost   (the host)
               + TP all-gather / reduce-scatter pairs + DTensor redistributions per TP module
               + CP: Ulysses all-to-alls of q, k, v and the output; or ring attention's blocks and K/V passing
               + EP dispatch / combine all-to-alls + FSDP: parameter all-gathers (forward and backward) and
                 the hooks per unit and per parameter tensor
               + the pipeline's sends; `coupled`: the encoders on stage 0 (imbalanced batches)
    + per step: FSDP's gradient reduce-scatter (after the last micro-batch)
    + per step: optimizer and gradient norm (per parameter group and tensor, plain or DTensor, + bytes), the step's
      small synchronising all-reduces, host work outside the model (`step_overhead_s`: data loading)
    + `omni`: the encoders on every rank, balanced (DESIGN.md §3), exposed beyond the pipeline's bubbles
      when the joint encoder-LLM schedule places their work there (`Efficiency.joint_pipeline`)

Collectives use an alpha-beta model per link class and per collective kind: a group whose ranks lie in one
node uses the intra-node link, otherwise the inter-node one. When a node has fewer compute units than
ranks (CPU "devices": processes sharing cores, `GpuSpec.cores`), the ranks' host and compute work is
time-shared: the step is at least their total work over the units; ranks of a CPU node also share its
memory bandwidth (`Efficiency.shared_memory`). Memory per GPU: weights, gradients
and AdamW states (divided by dp_shard under FSDP, copied over dp_replicate), activations of the
micro-batches in flight (only layer outputs with checkpointing), workspace. Every assumption that is a
choice (overlaps, efficiencies, overheads, what the implementation splits) lives in `Efficiency`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Literal

from omni_core.common.catalog import GpuSpec
from omni_core.common.plan import ParallelPlan, PlanError
from omni_core.estimator.workloads import BYTES, Layer, Workload

Layout = Literal["omni", "coupled"]
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# Host operators of the runtime's parallel code paths (counted from omni_core.parallel, fwd + bwd):
CP_A2A_OPS = 5  # Ulysses: chunk, stack, empty, all-to-all, cat per all-to-all
RING_LAYER_OPS = 45  # ring attention per layer: grouping, accumulators, K/V stacking, per ring step
RING_TILE_OPS = 48  # ring attention per (query tile, key tile): scores, mask, log-sum-exp merge; backward
RING_PLAN_OPS = 9  # the host's tile plan per (source, query tile, key tile), once per micro-batch
RING_BLOCK = 1024  # ContextParallelAttention's tile size
EP_OPS = 40  # EP dispatch: sort by expert, count exchange, split sizes, regrouping, in forward and backward
SYNC_COLLECTIVES = 2  # the step's all-reduces of its loss and token statistics
# TP: the gradient norm's full tensors (row- and column-sharded groups) and the one reduction of the replicated
# weights' partial gradients (`runtime.step.replicate_partial_grads`)
TP_SYNC_COLLECTIVES = 3


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
    score_s: float = 0.0  # seconds per attention score element (forward) beyond its FLOPs: softmax, masking
    attention_full: bool = False  # attention computes whole score matrices (no causal skipping): CPU SDPA
    step_overhead_s: float = 0.0  # host work per step not in the model (data loading, bookkeeping)
    optimizer_bytes_per_param: float = 36.0  # fused AdamW: read p, g, m, v (fp32), write p, m, v, bf16 copy
    dp_overlap: float = 0.8  # share of DP gradient traffic hidden behind backward (0: the CPU runtime's)
    tp_overlap: float = 0.0  # share of TP collectives hidden
    ep_overlap: float = 0.0
    cp_overlap: float = 0.5  # ring CP: share of the K/V passing hidden behind block attention
    pp_overlap: float = 0.5  # share of pipeline sends hidden
    grad_bytes: float = 4.0  # fp32 gradient accumulation and reduction
    # memory-bound seconds x this when a node's ranks run at once on a CPU device (`GpuSpec.cores`): they share
    # its memory bandwidth (a GPU has its own); measured by the ranks probe
    shared_memory: float = 1.0
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
    # `omni` layout (MegaScale-Omni's joint encoder-LLM pipeline): the share of the LLM pipeline's bubbles the
    # encoders' forward and backward can fill. Not all: an encoder forward must end before stage 0 needs its
    # embeddings, so the warm-up bubbles of late stages host the encoders of later micro-batches only.
    joint_pipeline: float = 0.75


@dataclass(frozen=True)
class Options:
    """Choices the Cell search makes per plan besides the plan's degrees."""

    micro_batch: int = 1  # samples per micro-batch per DP rank
    checkpoint: bool = False  # activation checkpointing (recompute each layer in backward)
    layout: Layout = "omni"
    lssp: int = 1  # `omni`: ranks an encoder's longest items are split over (long-short sequence parallelism)


@dataclass
class Estimate:
    plan: ParallelPlan
    options: Options
    step_time_s: float = math.inf
    samples_per_s: float = 0.0
    peak_mem_bytes: float = 0.0
    reason: str = ""  # why it does not fit ("" when it does)
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.reason


def ring_volume(kind: str, n: int) -> tuple[int, float]:
    """(latency steps, share of the buffer each rank moves) of a collective over n ranks, ring algorithms:
    all-reduce 2(n-1) steps moving 2(n-1)/n of it; all-gather, reduce-scatter and all-to-all n-1 steps
    moving (n-1)/n; p2p one step moving all of it."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n
    return 1, 1.0


def collective_time(kind: str, nbytes: float, n: int, bw: float, lat: float, calls: float = 1.0) -> float:
    """Alpha-beta time of `calls` collectives moving `nbytes` per rank in total over n ranks (`ring_volume`)."""
    if n <= 1 and kind != "p2p":
        return 0.0
    steps, volume = ring_volume(kind, n)
    return calls * steps * lat + volume * nbytes / bw


_UNSCALED = (1.0, 1.0)


@lru_cache(maxsize=64)
def _kind_scales(collectives: tuple[tuple[str, float, float], ...]) -> dict[str, tuple[float, float]]:
    return {kind: (lat, bw) for kind, lat, bw in collectives}


class Network:
    """Collective times on one Cell: the link by the group's span (intra- or inter-node), per-kind factors."""

    __slots__ = ("inter", "intra", "per_node", "scales")

    def __init__(self, gpu: GpuSpec, eff: Efficiency, gpus_per_node: int):
        self.intra = (gpu.intra_bw * eff.link, gpu.intra_lat)
        self.inter = (gpu.inter_bw * eff.link, gpu.inter_lat)
        self.per_node = gpus_per_node
        self.scales = _kind_scales(eff.collectives)

    def time(self, kind: str, nbytes: float, n: int, span: int, calls: float = 1.0) -> float:
        """`calls` collectives of `kind` over n ranks lying within `span` consecutive ranks."""
        if n <= 1 and kind != "p2p":
            return 0.0
        bw, lat = self.intra if span <= self.per_node else self.inter
        lat_scale, bw_scale = self.scales.get(kind, _UNSCALED)
        return collective_time(kind, nbytes, n, bw * bw_scale, lat * lat_scale, calls)


def partition(workload: Workload, pp: int) -> tuple[int, ...]:
    """Stage boundaries over the LLM layers (embedding, blocks, head), as the runtime splits them: contiguous
    blocks, the embedding with the first and the head with the last, cut where the cost prefix crosses k/pp
    of the total (nearest side), at least one block per stage. Memoised per workload."""
    key = ("cuts", pp)
    cuts = workload.cache.get(key)
    if cuts is None:
        n = len(workload.llm)
        sums = workload.cost_prefix
        total = sums[-1]
        bounds = [0]
        for k in range(1, pp):
            target = total * k / pp
            lowest, highest = max(bounds[-1] + 1, 2), n - 1 - (pp - k)
            i = lowest
            while i < highest and sums[i] < target:
                i += 1
            if i > lowest and abs(sums[i - 1] - target) <= abs(sums[i] - target):
                i -= 1
            bounds.append(i)
        bounds.append(n)
        cuts = workload.cache[key] = tuple(bounds)
    return cuts


def unbalanced_factor(cv: float, samples: float, ranks: int) -> float:
    """Without rebalancing, a step waits for the rank that drew the most encoder work: E[max] over `ranks`
    of totals over `samples` samples each, with per-sample spread `cv`, ~ mean * (1 + cv/sqrt(samples) *
    sqrt(2 ln ranks))."""
    if ranks <= 1 or not cv:
        return 1.0
    return 1.0 + cv / math.sqrt(samples) * math.sqrt(2 * math.log(ranks))


def device_seconds(sums: Sums, gpu: GpuSpec, eff: Efficiency, precision: str) -> tuple[float, float]:
    """(per sample, per call) forward seconds of some layers on the device: matmul FLOPs and operands,
    attention (the whole score matrices where the kernel computes them), memory-bound traffic."""
    peak = gpu.peak_flops(precision)
    attn = sums.attn_flops + (sums.causal_attn_flops if eff.attention_full else 0.0)
    mm_bw = eff.matmul_bw or gpu.mem_bw * eff.memory
    per_sample = (sums.flops / (peak * eff.matmul) + sums.mm_bytes / mm_bw + attn / (peak * eff.attention)
                  + sums.attn_scores * eff.score_s + sums.mem_bytes / (gpu.mem_bw * eff.memory))
    return per_sample, sums.mm_weight_bytes / mm_bw


def encoder_seconds_per_sample(workload: Workload, gpu: GpuSpec, eff: Efficiency) -> float:
    """Forward seconds of the encoders (and projectors) for one sample's images / clips on one GPU, host
    costs per image and per attention call included (a third of their forward + backward)."""
    if not workload.encoder:
        return 0.0
    enc = encoder_sums(workload)
    return (device_seconds(enc, gpu, eff, workload.precision)[0]
            + (enc.attn_calls * eff.attn_call_s + enc.sample_ops * eff.op_overhead_s) / 3)


@dataclass(frozen=True)
class Sums:
    """Totals over a group of layers (a pipeline stage, or the encoders), computed once per (workload, pp)
    so that each plan costs O(stages)."""

    flops: float
    expert_flops: float
    attn_flops: float
    causal_attn_flops: float  # of attn_flops, those of causal layers (the visible half)
    attn_scores: float
    mm_bytes: float
    mm_weight_bytes: float
    mem_bytes: float
    ops: float
    sample_ops: float
    expert_ops: float
    attn_calls: float
    tp_bytes: float
    tp_colls: float
    tp_modules: float
    a2a_bytes: float
    act_bytes: float
    params: float
    expert_params: float
    tensors: float
    expert_tensors: float
    units: float
    attn_layers: int  # layers with attention (CP re-splits or passes around their inputs)
    moe_layers: int
    routed_experts: int  # per MoE layer
    block_io: float  # outputs of attention layers (q-sized: what Ulysses re-splits)
    out_bytes: float  # outputs of every layer (what checkpointing keeps)
    max_act: float
    max_params: float
    boundary: float  # the output of the last layer (the pipeline message)

    @classmethod
    def of(cls, layers: tuple[Layer, ...] | list[Layer], experts: int = 0) -> Sums:
        def total(name: str) -> float:
            return sum(getattr(l, name) for l in layers)

        return cls(
            **{name: total(name) for name in (
                "flops", "expert_flops", "attn_flops", "attn_scores", "mm_bytes", "mm_weight_bytes", "mem_bytes",
                "ops", "sample_ops", "expert_ops", "attn_calls", "tp_bytes", "tp_colls", "tp_modules", "a2a_bytes",
                "act_bytes", "params", "expert_params", "tensors", "expert_tensors", "units")},
            causal_attn_flops=sum(l.attn_flops for l in layers if l.causal),
            attn_layers=sum(1 for l in layers if l.attn_flops or l.attn_calls),
            moe_layers=sum(1 for l in layers if l.a2a_bytes), routed_experts=experts,
            block_io=sum(l.out_bytes for l in layers if l.attn_flops or l.attn_calls),
            out_bytes=sum(l.out_bytes for l in layers),
            max_act=max((l.act_bytes for l in layers), default=0.0),
            max_params=max((l.params for l in layers), default=0.0),
            boundary=layers[-1].out_bytes if layers else 0.0,
        )


def stage_sums(workload: Workload, pp: int) -> tuple[Sums, ...]:
    key = ("stages", pp)
    stages = workload.cache.get(key)
    if stages is None:
        cuts = partition(workload, pp)
        experts = workload.shape.num_experts
        stages = workload.cache[key] = tuple(Sums.of(workload.llm[a:b], experts) for a, b in itertools.pairwise(cuts))
    return stages


def stage_groups(workload: Workload, pp: int) -> tuple[tuple[Sums, int, int], ...]:
    """The pipeline's distinct stages as (sums, index of the first such stage, how many), stage 0 apart:
    equal stages cost the same, and the first of them keeps the most micro-batches in flight."""
    key = ("groups", pp)
    groups = workload.cache.get(key)
    if groups is None:
        found: dict[tuple[Sums, bool], list[int]] = {}
        for s, st in enumerate(stage_sums(workload, pp)):
            found.setdefault((st, s == 0), []).append(s)
        groups = workload.cache[key] = tuple((st, where[0], len(where)) for (st, _), where in found.items())
    return groups


def encoder_sums(workload: Workload) -> Sums:
    sums = workload.cache.get("encoder")
    if sums is None:
        sums = workload.cache["encoder"] = Sums.of(workload.encoder)
    return sums


def ring_tiles(workload: Workload, tokens: float, cp: int) -> tuple[float, float]:
    """(tile pairs one rank computes, tile side) of ring attention over `tokens` packed tokens: zig-zag
    chunks of tokens / 2cp cut into tiles of at most RING_BLOCK; a pair is computed when some query sees
    some key in it: the diagonal always, an earlier tile g tiles back when one document spans the gap
    (probability ~ 1 - gap / L_w, L_w = E[L^2]/E[L]: the length of the document a random token is in)."""
    chunk = tokens / (2 * cp)
    side = min(chunk, RING_BLOCK)
    n = 2 * cp * math.ceil(chunk / side)  # tiles along the sequence
    doc = workload.doc_span or tokens
    pairs = float(n)  # the diagonal
    for gap in range(1, n):
        p = 1.0 - (gap - 1) * side / doc
        if p <= 0:
            break
        pairs += (n - gap) * min(1.0, p)
    return pairs / cp, side


def schedule_refusal(plan: ParallelPlan, m: int) -> str:
    """Why the runtime would refuse to run `m` micro-batches per step through `plan`'s pipeline schedule
    (`ParallelPlan.check_microbatches`, torch.distributed.pipelining's rules), or "" when it runs them."""
    try:
        plan.check_microbatches(m)
    except PlanError as err:
        return str(err)
    return ""


def evaluate(
    workload: Workload, gpu: GpuSpec, plan: ParallelPlan, options: Options, *,
    gpus_per_node: int, eff: Efficiency = Efficiency(),
) -> Estimate:
    """Step time and peak memory of `plan` (its world = the Cell's GPUs). Never raises for a plan that does
    not fit: the Estimate's `reason` says why (memory, batch split)."""
    est = Estimate(plan, options)
    dp, tp, cp, pp, ep = plan.dp, plan.tp, plan.cp, plan.pp, plan.ep
    mb = options.micro_batch
    m, rest = divmod(workload.global_batch, dp * mb)  # micro-batches per step per pipeline
    est.reason = (f"global_batch={workload.global_batch} is not divisible by dp={dp} x micro_batch={mb}" if rest
                  else schedule_refusal(plan, m))
    if est.reason:
        est.peak_mem_bytes = math.inf  # not a memory problem: never the "closest to fitting" plan
        return est
    if gpu.cores and eff.shared_memory != 1.0 and min(plan.world_size, gpus_per_node, gpu.cores) > 1:
        # ranks stream at once: memory-bound work (not matmul operands, which stay in cache) slows down
        eff = replace(eff, memory=eff.memory / eff.shared_memory, matmul_bw=eff.matmul_bw or gpu.mem_bw * eff.memory)
    peak = gpu.peak_flops(workload.precision)
    mm_rate, attn_rate, mem_rate = peak * eff.matmul, peak * eff.attention, gpu.mem_bw * eff.memory
    op_s = eff.op_overhead_s
    split = tp * cp  # ranks one micro-batch's LLM work is spread over
    net = Network(gpu, eff, gpus_per_node)
    recompute = 1.0 if options.checkpoint else 0.0
    passes = 3.0 + recompute  # forward, backward (2x), recomputed forward
    wbytes = BYTES[workload.precision]
    state_bytes = wbytes + eff.grad_bytes + (12.0 if wbytes == 2 else 8.0)  # + fp32 master with 16-bit weights
    shards = plan.dp_shard * cp  # FSDP shards model states over dp_shard x cp; dp_replicate copies them
    fsdp = dp * cp > 1  # the runtime wraps every block in FSDP (HSDP) whenever there is more than one replica
    sharded = fsdp or tp > 1
    per_tensor = eff.dtensor_s if sharded else eff.tensor_s
    # the runtime's AdamW groups parameters by decay and by kind (plain, or DTensors of one mesh): the dense
    # model's, TP's (encoders are not split by TP), the experts' under EP
    param_groups_s = 2 * (1 + (tp > 1) + (ep > 1)) * (eff.dtensor_group_s if sharded else eff.tensor_group_s)
    expert_shards = max(1, shards // ep)  # experts' own FSDP group: the ranks with the same EP index
    tokens = workload.tokens_per_sample * mb  # packed tokens per micro-batch
    rank_span = tp * cp * plan.dp_shard  # ranks of one FSDP group lie within this many consecutive ranks
    ep_split = cp if not eff.split_encoders_experts else split  # tokens an EP rank holds are its own
    pipelined = pp > 1
    bubble_ranks = plan.world_size // pp + 1  # a pipeline send crosses this many ranks

    enc = encoder_sums(workload) if workload.encoder else None
    imbalance = unbalanced_factor(workload.encoder_cv, m * mb, dp) if options.layout == "coupled" else 1.0
    enc_split = split if eff.split_encoders_experts else 1

    def fsdp_time(params: float, units: float, tensors: float, expert_params: float, expert_units: float) -> tuple:
        """(per micro-batch, per step) seconds of FSDP over a rank's units: each unit's wrapper (hooks, copies)
        and its collectives: the parameter all-gathers (forward and backward) per micro-batch, the gradients'
        reduce-scatter (+ HSDP all-reduce) once per step, after the last micro-batch. Their latency counts
        per unit and call (a collective waits for every rank); of their volume, what is not hidden behind
        compute (`dp_overlap`)."""
        if not fsdp:
            return 0.0, 0.0
        exposed = 1 - eff.dp_overlap

        def cost(kind: str, nbytes: float, n: int, span: int, calls: float) -> float:
            latency = net.time(kind, 0.0, n, span, calls)
            return latency + exposed * (net.time(kind, nbytes, n, span, calls) - latency)

        all_units = units + expert_units
        gather = 2 * cost("all_gather", params * wbytes, shards, rank_span, units)
        reduce = (cost("reduce_scatter", params * eff.grad_bytes, shards, rank_span, units)
                  + cost("all_reduce", params * eff.grad_bytes / shards, plan.dp_replicate,
                         rank_span * plan.dp_replicate, all_units))
        if expert_units:
            gather += 2 * cost("all_gather", expert_params * wbytes, expert_shards, rank_span, expert_units)
            reduce += cost("reduce_scatter", expert_params * eff.grad_bytes, expert_shards, rank_span, expert_units)
        return all_units * eff.fsdp_unit_s + tensors * eff.fsdp_tensor_s + gather, reduce

    def optimizer_time(params: float, tensors: float) -> float:
        return tensors * per_tensor + params * eff.optimizer_bytes_per_param / mem_rate

    # encoders: `coupled` runs them on stage 0 with the LLM's data split (replicated over TP x CP unless
    # they are split too); `omni` on every rank, balanced, after the pipeline (see below)
    enc_compute_mb = enc_host_mb = enc_fsdp_mb = enc_fsdp_step = enc_opt = enc_mem = 0.0
    if enc is not None:
        per_sample, per_call = device_seconds(enc, gpu, eff, workload.precision)
        enc_compute = (per_sample * mb + per_call) / enc_split
        enc_host = (enc.ops + enc.sample_ops * mb) * op_s + enc.attn_calls * mb * eff.attn_call_s
        enc_compute_mb, enc_host_mb = passes * enc_compute * imbalance, enc_host * passes / 3
        enc_params = enc.params / enc_split
        enc_fsdp_mb, enc_fsdp_step = fsdp_time(enc_params, enc.units, enc.tensors, 0.0, 0.0)
        enc_opt = optimizer_time(enc_params / (shards if fsdp else 1), enc.tensors)
        enc_act = (enc.out_bytes + enc.max_act) if options.checkpoint else enc.act_bytes
        if options.layout == "coupled":
            enc_group, enc_act = shards, enc_act * mb / enc_split
        else:  # the rank's share of the samples, or the slice of the longest item it holds
            enc_group = plan.world_size
            enc_act *= max(workload.global_batch / plan.world_size / m, workload.encoder_max_item / options.lssp)
        enc_mem = enc.params * state_bytes / max(enc_group, 1) + enc_act * (1 + eff.workspace_frac)

    # memory first: most candidate plans of a large model do not fit, and that is cheap to find out
    groups = stage_groups(workload, pp)
    peak_mem, worst = 0.0, {}
    for st, s, _ in groups:
        dense_params = (st.params - st.expert_params) / tp
        expert_params = st.expert_params / (ep * (tp if eff.split_encoders_experts else 1))
        states = dense_params * state_bytes / shards + expert_params * state_bytes / expert_shards
        gathered = 2 * st.max_params / tp * wbytes if shards > 1 else 0.0
        in_flight = m if plan.pp_schedule == "GPipe" else min(m, pp - s)
        if options.checkpoint:
            acts = (st.out_bytes * in_flight + st.max_act) * mb / split
        else:
            acts = st.act_bytes * mb / split * in_flight
        mem = states + gathered + acts * (1 + eff.workspace_frac)
        if enc is not None and (options.layout == "omni" or s == 0):
            mem += enc_mem
        if mem > peak_mem:
            peak_mem = mem
            worst = {"stage": s, "states_gb": states / 1e9, "activations_gb": acts / 1e9}
    est.peak_mem_bytes = peak_mem
    if peak_mem > gpu.usable_bytes:
        est.reason = (f"out of memory: {peak_mem / 1e9:.1f} GB needed on stage {worst['stage']} "
                      f"({worst['states_gb']:.1f} GB model states, {worst['activations_gb']:.1f} GB activations) > "
                      f"{gpu.usable_bytes / 1e9:.1f} GB usable on {gpu.name}")
        return est

    kv_share = 1.0
    if cp > 1 and plan.cp_kind == "ulysses":
        heads, kv_heads = workload.shape.n_heads // tp, max(1, workload.shape.n_kv_heads // tp)
        kv_share = math.lcm(kv_heads, cp) / heads  # K/V heads sent (repeated to a multiple of cp) per query head
    ring = cp > 1 and plan.cp_kind == "ring"
    if ring:
        pairs, side = ring_tiles(workload, tokens, cp)
        heads = workload.shape.n_heads / tp
        head_dim = workload.head_dim
        # per layer, forward + backward: QK^T, PV (forward), recomputed QK^T, dV, dP, dQ, dK (backward) on
        # full tiles in fp32, ~20 elementwise passes over the tile's scores, the tile loop's operators
        tile_compute = pairs * heads * side * side * (14 * head_dim / mm_rate + 20 * 4 * 2 / mem_rate)
        ring_host = (RING_LAYER_OPS + cp * 4 + pairs * RING_TILE_OPS) * op_s
        ring_plan = cp * (2 * math.ceil(tokens / (2 * cp) / side)) ** 2 * RING_PLAN_OPS * op_s

    # per stage: one micro-batch's time; per step, what its ranks' cores do (`device`) and what the runtime's
    # wrappers and links take (measured together with the ranks, so already shared and already waiting for
    # each other); a rank's own work, profiled alone, is stretched by the ranks' straggling
    straggle = eff.straggle if plan.world_size > 1 else 1.0
    stage_times, device_times, runtime_times, step_times, counts = [], [], [], [], []
    def stage_cost(st: Sums, first: bool) -> tuple[float, float, float, float, float, float]:
        """(micro-batch time, device work, runtime work, per-step time, dense and expert parameters per rank)
        of one stage; stage 0 (`first`) also holds the root FSDP unit and, `coupled`, the encoders."""
        per_sample, per_call = device_seconds(st, gpu, eff, workload.precision)
        if ring:  # ring attention replaces the per-document kernel (priced below)
            per_sample -= ((st.attn_flops + (st.causal_attn_flops if eff.attention_full else 0.0)) / attn_rate
                           + st.attn_scores * eff.score_s)
        forward = per_sample * mb / split + per_call / tp
        if not eff.split_encoders_experts:  # every TP rank runs the experts on all of its tokens
            forward += st.expert_flops * mb / mm_rate * (1 / cp - 1 / split)
        compute = passes * forward
        ops = st.ops - st.expert_ops * (1 - 1 / ep) + st.sample_ops * mb + (EP_OPS * st.moe_layers if ep > 1 else 0)
        host = ops * op_s * passes / 3
        if ring:
            compute += st.attn_layers * tile_compute * (1 + recompute / 3)
            host += st.attn_layers * ring_host + ring_plan
        else:
            host += st.attn_calls * mb * eff.attn_call_s * passes / 3
        comm = wrappers = 0.0
        if tp > 1:
            per_coll = st.tp_bytes * mb / cp / max(st.tp_colls, 1)
            pair = (net.time("all_gather", per_coll, tp, tp, 0) + net.time("reduce_scatter", per_coll, tp, tp, 0))
            comm += (1 - eff.tp_overlap) * st.tp_colls * pair * (2 + recompute) / 2  # forward RS/AG mirrored
            wrappers += st.tp_modules * eff.tp_module_s
        if cp > 1:
            q_bytes = st.block_io * mb / split
            if ring:  # K/V blocks travel cp - 1 steps forward and backward, dK/dV accumulators cp steps
                kv = 2 * q_bytes * workload.shape.n_kv_heads / workload.shape.n_heads
                passing = ((cp - 1) * (1 + recompute / 3) * 2 * net.time("p2p", kv / st.attn_layers, 2, tp * cp)
                           + cp * net.time("p2p", kv * 4 / wbytes / st.attn_layers, 2, tp * cp)) * st.attn_layers
                comm += max(0.0, passing - eff.cp_overlap * st.attn_layers * tile_compute)
            else:  # Ulysses: q, k, v and the output re-split between tokens and heads, forward and backward
                forward = (2 * net.time("all_to_all", q_bytes / st.attn_layers, cp, tp * cp)
                           + 2 * net.time("all_to_all", kv_share * q_bytes / st.attn_layers, cp, tp * cp))
                comm += forward * st.attn_layers * (2 + recompute)
                host += st.attn_layers * 4 * CP_A2A_OPS * op_s * (2 + recompute)
            if st.moe_layers:  # the balancing loss sums routing statistics over the sequence's ranks
                comm += net.time("all_reduce", 4.0 * st.routed_experts, cp, tp * cp, 4 * st.moe_layers)
        if ep > 1:
            a2a = st.a2a_bytes * mb / ep_split
            comm += (1 - eff.ep_overlap) * (
                2 * net.time("all_to_all", a2a, ep, tp * ep) * passes / 3
                + net.time("all_to_all", 4.0 * st.routed_experts, ep, tp * ep, st.moe_layers))
        send = 0.0
        if pipelined:  # activations forward, their gradients back, through every virtual stage
            send = plan.virtual_stages * ((1 - eff.pp_overlap) * 2 * net.time(
                "p2p", st.boundary * mb / split, 2, bubble_ranks, 0) + eff.pp_microbatch_s)
        dense_params = (st.params - st.expert_params) / tp
        expert_params = st.expert_params / (ep * (tp if eff.split_encoders_experts else 1))
        expert_units = st.moe_layers * st.routed_experts / ep if ep > 1 else 0.0
        tensors = st.tensors - st.expert_tensors * (1 - 1 / ep)
        fsdp_mb, fsdp_step = fsdp_time(dense_params + (expert_params if ep == 1 else 0.0), st.units + first, tensors,
                                       expert_params, expert_units)
        opt = param_groups_s + optimizer_time((dense_params + expert_params) / (shards if fsdp else 1), tensors)
        if enc is not None and options.layout == "coupled" and first:
            compute += enc_compute_mb
            host += enc_host_mb
            fsdp_mb += enc_fsdp_mb
            fsdp_step += enc_fsdp_step
            opt += enc_opt
        compute, host = compute * straggle, host * straggle
        return (compute + host + wrappers + comm + send + fsdp_mb, m * (compute + host),
                m * (wrappers + comm + send + fsdp_mb) + fsdp_step + opt, opt + fsdp_step)

    for st, s, count in groups:
        stage_time, device, runtime, per_step = stage_cost(st, s == 0)
        stage_times.append(stage_time)
        device_times.append(device * count)
        runtime_times.append(runtime * count)
        step_times.append(per_step)
        counts.append(count)

    slowest = max(stage_times)
    if plan.pp_schedule == "Interleaved1F1B":
        pipeline = (m + (pp - 1) / plan.virtual_stages) * slowest
    else:
        pipeline = (m - 1) * slowest + sum(t * n for t, n in zip(stage_times, counts))
    bubble = pipeline - m * slowest if pipelined else 0.0
    encoder = 0.0
    encoder = long_item = 0.0
    if enc is not None and options.layout == "omni":
        # Encoders on every rank, data parallel over the world: grouped reordering balances their samples,
        # except that no rank can finish before the longest item (image, clip) it got, which LSSP splits
        # over `lssp` ranks with Ulysses (all-to-alls of q, k, v and the output in every encoder layer).
        # The joint schedule places this work in the pipeline's bubbles (`joint_pipeline` of them).
        per_sample = passes * encoder_seconds_per_sample(workload, gpu, eff) * straggle
        balanced = per_sample * workload.global_batch / plan.world_size
        lssp = options.lssp
        long_item = per_sample * workload.encoder_max_item / lssp
        if lssp > 1:
            item_io = enc.block_io * workload.encoder_max_item / lssp
            long_item += (2 + recompute) * 4 * net.time("all_to_all", item_io / max(enc.attn_layers, 1), lssp, lssp,
                                                        enc.attn_layers)
        work = max(balanced, long_item)
        work += (enc.ops * op_s * passes / 3 + enc_fsdp_mb) * m + enc_fsdp_step + enc_opt  # FSDP reduces its grads
        encoder = max(work - eff.joint_pipeline * bubble, 0.0)
    syncs = SYNC_COLLECTIVES + (1 if fsdp else 0) + TP_SYNC_COLLECTIVES * (tp > 1) + (ep > 1) + pipelined
    sync = net.time("all_reduce", 64.0, plan.world_size, plan.world_size, syncs)
    step = pipeline + max(step_times) + encoder + sync + eff.step_overhead_s
    ranks_per_node = min(plan.world_size, gpus_per_node)
    if gpu.cores and ranks_per_node > gpu.cores:
        # the node's ranks time-share its cores: a step takes at least their average work (device, wrappers,
        # the links' copies: all of it runs on the cores) over the share of a core each gets
        share = ranks_per_node / gpu.cores
        work = (sum(device_times) + sum(runtime_times)) / pp + eff.step_overhead_s
        step = max(step, work * share + encoder + sync)

    est.step_time_s = step
    est.samples_per_s = workload.global_batch / step
    est.breakdown = {"pipeline_s": pipeline, "bubble_s": bubble, "encoder_s": encoder, "encoder_long_item_s": long_item,
                     "optimizer_s": max(step_times), "sync_s": sync, "host_s": eff.step_overhead_s,
                     "device_s": device_times[0], "runtime_s": runtime_times[0], **worst}
    return est
