"""The analytic cost model: one plan of one workload on one GPU type -> step time, memory, or the reason
it does not fit.

Time of one training step (per GPU, the slowest stage rules):

    pipeline   1F1B / GPipe: (m - 1) * max_s(f_s + b_s) + sum_s(f_s + b_s)   (warm-up + steady + cool-down);
               interleaved: (m + (pp - 1) / v) * max_s(f_s + b_s)
    f_s, b_s   per micro-batch: FLOPs / (peak * efficiency) + memory-bound bytes / bandwidth + per-op overhead
               + exposed TP / CP / EP collectives + the pipeline send; b = 2 f (+ f when recomputing)
    + exposed data-parallel gradient traffic ((1 - dp_overlap) of it) + optimizer step + fixed step overhead
    + encoder work (layout `omni`: spread evenly over all ranks and balanced; `coupled`: inside stage 0, with
      the load imbalance of unbalanced batches)

Collectives use an alpha-beta model per link class: a group that fits in one node uses the intra-node link,
otherwise the inter-node one. Memory per GPU: weights, gradients and AdamW states (divided by dp_shard under
FSDP, copied over dp_replicate), activations of the micro-batches in flight (only stage boundaries with checkpointing), workspace.
Every assumption that is a choice (overlaps, efficiencies, overheads) lives in `Efficiency` and can be set.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

from omni_core.estimator.catalog import GpuSpec
from omni_core.estimator.workloads import BYTES, Workload
from omni_core.parallel import ParallelPlan

Layout = Literal["omni", "coupled"]


@dataclass(frozen=True)
class Efficiency:
    """Shares of the catalogue's peaks a training step reaches, overheads and overlap assumptions.

    Defaults are typical large-model GPU figures (Megatron-LM / torchtitan reach 40-60% MFU); the
    micro-profile (`calibrate.py`) replaces them with measured values for the device at hand."""

    matmul: float = 0.6  # of peak FLOP/s for weight matmuls / convolutions
    attention: float = 0.45  # of peak FLOP/s for attention (flash kernels)
    memory: float = 0.75  # of memory bandwidth for memory-bound ops
    link: float = 0.8  # of link bandwidth reached by collectives
    op_overhead_s: float = 3e-6  # per operator call not hidden by asynchronous launches
    attn_call_s: float = 0.0  # per attention call (per document: the CPU runtime loops over documents)
    step_overhead_s: float = 0.0  # host work per step not on the device (data loading, bookkeeping, syncs)
    optimizer_bytes_per_param: float = 36.0  # AdamW: read p, g, m, v (fp32), write p, m, v, bf16 copy
    dp_overlap: float = 0.8  # share of DP gradient traffic hidden behind backward (0: the CPU runtime's)
    tp_overlap: float = 0.0  # share of TP collectives hidden
    ep_overlap: float = 0.0
    cp_overlap: float = 0.5  # ring CP: share of the K/V passing hidden behind block attention
    pp_overlap: float = 0.5  # share of pipeline sends hidden
    grad_bytes: float = 4.0  # fp32 gradient accumulation and reduction
    workspace_frac: float = 0.05  # of the activations: temporaries, allocator slack


@dataclass(frozen=True)
class Options:
    """Choices the Cell search makes per plan besides the plan's degrees."""

    micro_batch: int = 1  # samples per micro-batch per DP rank
    checkpoint: bool = False  # activation checkpointing (recompute each layer in backward)
    layout: Layout = "omni"


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


def collective_time(kind: str, nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring algorithms: all-reduce moves 2(n-1)/n of the buffer in 2(n-1) steps; all-gather,
    reduce-scatter and all-to-all (n-1)/n in n-1 steps; p2p the whole buffer in one."""
    if n <= 1 and kind != "p2p":
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * lat + (n - 1) / n * nbytes / bw
    return lat + nbytes / bw


def _link(gpu: GpuSpec, eff: Efficiency, span: int, gpus_per_node: int) -> tuple[float, float]:
    """(bandwidth, latency) for a group whose ranks lie within `span` consecutive ranks."""
    if span <= gpus_per_node:
        return gpu.intra_bw * eff.link, gpu.intra_lat
    return gpu.inter_bw * eff.link, gpu.inter_lat


def partition(workload: Workload, pp: int, weight: str = "flops") -> tuple[int, ...]:
    """Stage boundaries over the LLM layers balancing `weight` (cut where the prefix sum crosses k/pp of the
    total, nearest side), memoised per workload; every stage gets at least one layer."""
    key = (pp, weight)
    cuts = workload.cache.get(key)
    if cuts is None:
        n = len(workload.llm)
        sums = [a + b for a, b in zip(workload.prefix[weight], workload.prefix["attn_flops"])]
        total = sums[-1]
        bounds = [0]
        for k in range(1, pp):
            target = total * k / pp
            i = bounds[-1] + 1
            while i < n - (pp - k) and sums[i] < target:
                i += 1
            if i > bounds[-1] + 1 and abs(sums[i - 1] - target) <= abs(sums[i] - target):
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


def encoder_seconds_per_sample(workload: Workload, gpu: GpuSpec, eff: Efficiency) -> float:
    """Forward seconds of the encoders (and projectors) for one sample's images / clips on one GPU."""
    if not workload.encoder:
        return 0.0
    peak = gpu.peak_flops(workload.precision)
    return sum(l.flops / (peak * eff.matmul) + l.attn_flops / (peak * eff.attention)
               + l.mem_bytes / (gpu.mem_bw * eff.memory) + l.attn_calls * eff.attn_call_s for l in workload.encoder)


@dataclass(frozen=True)
class StageSums:
    """A pipeline stage's layer totals, computed once per (workload, pp) so each plan costs O(stages)."""

    flops: float
    attn_flops: float
    mem_bytes: float
    ops: float
    attn_calls: float
    tp_bytes: float
    a2a_bytes: float
    act_bytes: float
    params: float
    expert_params: float
    blocks: int  # layers with TP collectives
    block_io: float  # outputs of attention layers (what CP re-splits or passes around)
    out_bytes: float  # outputs of every layer (what checkpointing keeps)
    max_act: float
    max_params: float
    boundary: float  # the stage's output (the pipeline message)


def stage_sums(workload: Workload, pp: int) -> tuple[StageSums, ...]:
    key = ("stages", pp)
    stages = workload.cache.get(key)
    if stages is None:
        cuts = partition(workload, pp)
        stages = []
        for a, b in itertools.pairwise(cuts):
            layers = workload.llm[a:b]
            spans = {name: workload.span(name, a, b) for name in (
                "flops", "attn_flops", "mem_bytes", "ops", "attn_calls", "tp_bytes", "a2a_bytes", "act_bytes",
                "params", "expert_params")}
            stages.append(StageSums(
                **spans, blocks=sum(1 for l in layers if l.tp_bytes),
                block_io=sum(l.out_bytes for l in layers if l.attn_flops), out_bytes=sum(l.out_bytes for l in layers),
                max_act=max(l.act_bytes for l in layers), max_params=max(l.params for l in layers),
                boundary=layers[-1].out_bytes,
            ))
        stages = workload.cache[key] = tuple(stages)
    return stages


def evaluate(
    workload: Workload, gpu: GpuSpec, plan: ParallelPlan, options: Options, *,
    gpus_per_node: int, eff: Efficiency = Efficiency(),
) -> Estimate:
    """Step time and peak memory of `plan` (its world = the Cell's GPUs). Never raises for a plan that does
    not fit: the Estimate's `reason` says why (memory, batch split)."""
    est = Estimate(plan, options)
    dp, tp, cp, pp, ep = plan.dp, plan.tp, plan.cp, plan.pp, plan.ep
    mb = options.micro_batch
    if workload.global_batch % (dp * mb):
        est.reason = f"global_batch={workload.global_batch} is not divisible by dp={dp} x micro_batch={mb}"
        return est
    m = workload.global_batch // (dp * mb)  # micro-batches per step per pipeline
    peak = gpu.peak_flops(workload.precision)
    mm_rate, attn_rate, mem_rate = peak * eff.matmul, peak * eff.attention, gpu.mem_bw * eff.memory
    shard = mb / (tp * cp)  # samples' worth of work per GPU per micro-batch

    tp_bw, tp_lat = _link(gpu, eff, tp, gpus_per_node)
    cp_bw, cp_lat = _link(gpu, eff, tp * cp, gpus_per_node)
    ep_bw, ep_lat = _link(gpu, eff, tp * ep, gpus_per_node)
    shard_bw, shard_lat = _link(gpu, eff, tp * cp * plan.dp_shard, gpus_per_node)
    dp_bw, dp_lat = _link(gpu, eff, tp * cp * dp, gpus_per_node)
    pp_bw, pp_lat = _link(gpu, eff, plan.world_size // pp + 1, gpus_per_node)

    enc = workload.encoder
    enc_time_per_sample = encoder_seconds_per_sample(workload, gpu, eff)
    enc_ops = sum(l.ops for l in enc) * eff.op_overhead_s if enc else 0.0
    imbalance = unbalanced_factor(workload.encoder_cv, m * mb, dp) if options.layout == "coupled" else 1.0

    wbytes = BYTES[workload.precision]
    state_bytes = wbytes + eff.grad_bytes + 12.0 if wbytes == 2 else wbytes + eff.grad_bytes + 8.0  # + fp32 master
    recompute = 1.0 if options.checkpoint else 0.0
    if enc:
        enc_params = sum(l.params for l in enc)
        enc_group = plan.world_size if options.layout == "omni" else plan.dp_shard * tp
        enc_act = (max(l.out_bytes for l in enc) * len(enc) + max(l.act_bytes for l in enc)) if options.checkpoint \
            else sum(l.act_bytes for l in enc)
        enc_mem = enc_params * state_bytes / enc_group + enc_act * mb / (tp * cp) * (1 + eff.workspace_frac)
    stage_times, peak_mem, worst = [], 0.0, {}
    dp_time = opt_time = 0.0
    for s, st in enumerate(stage_sums(workload, pp)):
        compute = (st.flops / mm_rate + st.attn_flops / attn_rate + st.mem_bytes / mem_rate) * shard
        overhead = st.ops * eff.op_overhead_s + st.attn_calls * mb / cp * eff.attn_call_s
        comm = 0.0
        if tp > 1:
            comm = (1 - eff.tp_overlap) * (collective_time("all_reduce", st.tp_bytes * mb / cp, tp, tp_bw, tp_lat)
                                           + 2 * (tp - 1) * tp_lat * max(st.blocks - 1, 0))
        if cp > 1:
            block_io = st.block_io * mb / (tp * cp)
            if plan.cp_kind == "ring":  # K/V blocks passed around the ring, overlapped with block attention
                cp_comm = (cp - 1) * (cp_lat + block_io / cp_bw)
                hidden = eff.cp_overlap * st.attn_flops * shard / attn_rate
                comm += max(0.0, cp_comm - hidden)
            else:  # Ulysses: q, k, v and the output re-split between sequence and heads
                comm += 4 * collective_time("all_to_all", block_io, cp, cp_bw, cp_lat)
        if ep > 1:
            comm += (1 - eff.ep_overlap) * 2 * collective_time("all_to_all", st.a2a_bytes * shard, ep, ep_bw, ep_lat)
        send = 0.0
        if pp > 1:  # interleaving sends each micro-batch through every virtual stage
            send = plan.virtual_stages * (1 - eff.pp_overlap) * collective_time(
                "p2p", st.boundary * mb / (tp * cp), 2, pp_bw, pp_lat)
        fwd = compute + overhead + comm + send
        bwd = (2 + recompute) * (compute + overhead + comm) + send
        if options.layout == "coupled" and s == 0 and enc:
            enc_fwd = enc_time_per_sample * mb / tp * imbalance + enc_ops
            fwd += enc_fwd
            bwd += (2 + recompute) * enc_fwd
        stage_times.append((fwd, bwd))

        # memory
        dense = (st.params - st.expert_params) / tp
        experts = st.expert_params / (tp * ep)
        shards = plan.dp_shard  # FSDP shards model states over dp_shard; dp_replicate copies them
        states = dense * state_bytes / shards + experts * state_bytes * ep / (shards * cp)
        gathered = 2 * st.max_params / tp * wbytes if shards > 1 else 0.0
        in_flight = m if plan.pp_schedule == "GPipe" else min(m, pp - s)
        if options.checkpoint:
            acts = (st.out_bytes * in_flight + st.max_act) * shard
        else:
            acts = st.act_bytes * shard * in_flight
        mem = states + gathered + acts * (1 + eff.workspace_frac)
        if enc and (options.layout == "omni" or s == 0):
            mem += enc_mem
        if mem > peak_mem:
            peak_mem = mem
            worst = {"stage": s, "states_gb": states / 1e9, "activations_gb": acts / 1e9}

        grad_bytes = (dense + experts) * eff.grad_bytes
        traffic = 0.0
        if shards > 1:
            traffic = (collective_time("reduce_scatter", grad_bytes, shards, shard_bw, shard_lat)
                       + 2 * collective_time("all_gather", (dense + experts) * wbytes, shards, shard_bw, shard_lat))
        traffic += collective_time("all_reduce", grad_bytes / shards, plan.dp_replicate, dp_bw, dp_lat)
        dp_time = max(dp_time, traffic)
        opt_time = max(opt_time, (dense + experts) / shards * eff.optimizer_bytes_per_param / mem_rate)

    slowest = max(f + b for f, b in stage_times)
    if plan.pp_schedule == "Interleaved1F1B":
        pipeline = (m + (pp - 1) / plan.virtual_stages) * slowest
    else:
        pipeline = (m - 1) * slowest + sum(f + b for f, b in stage_times)
    encoder = 0.0
    if enc and options.layout == "omni":
        # encoders on every rank, their samples balanced across all of them (grouped reordering + LSSP)
        samples_per_gpu = workload.global_batch / plan.world_size
        encoder = (3 + recompute) * (enc_time_per_sample * samples_per_gpu + enc_ops * m)
        encoder += (1 - eff.dp_overlap) * collective_time(
            "all_reduce", enc_params * eff.grad_bytes, plan.world_size, dp_bw, dp_lat)
    exposed_dp = (1 - eff.dp_overlap) * dp_time
    step = pipeline + encoder + exposed_dp + opt_time + eff.step_overhead_s

    est.peak_mem_bytes = peak_mem
    est.step_time_s = step
    est.samples_per_s = workload.global_batch / step
    est.breakdown = {"pipeline_s": pipeline, "bubble_s": pipeline - m * slowest if pp > 1 else 0.0,
                     "encoder_s": encoder, "dp_exposed_s": exposed_dp, "optimizer_s": opt_time,
                     "host_s": eff.step_overhead_s,
                     **worst}
    if peak_mem > gpu.usable_bytes:
        est.reason = (f"out of memory: {peak_mem / 1e9:.1f} GB needed on stage {worst['stage']} "
                      f"({worst['states_gb']:.1f} GB model states, {worst['activations_gb']:.1f} GB activations) > "
                      f"{gpu.usable_bytes / 1e9:.1f} GB usable on {gpu.name}")
    return est
