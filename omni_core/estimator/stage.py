"""One pipeline stage's time: a micro-batch's forward + backward and what the stage's weights cost per step.

The terms of t_s in `cost`'s formula, each a function: the device (FLOPs and bytes, `device_seconds`), the host
(aten operators, attention calls), TP's all-gather / reduce-scatter pairs, CP's Ulysses all-to-alls or ring
attention's tiles and K/V passing, EP's dispatch and combine, the pipeline's sends, and FSDP (gathers per
micro-batch, gradient reduction per step) with the optimizer. They read a stage's `pipeline.Sums`; the
encoders' are priced with the same functions (`encoders`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from omni_core.common.catalog import GpuSpec
from omni_core.estimator.pipeline import Sums
from omni_core.estimator.terms import Efficiency, PlanTerms
from omni_core.estimator.workloads import Workload

# Host operators of the runtime's parallel code paths (counted from omni_core.parallel, fwd + bwd):
CP_A2A_OPS = 5  # Ulysses: chunk, stack, empty, all-to-all, cat per all-to-all
RING_LAYER_OPS = 45  # ring attention per layer: grouping, accumulators, K/V stacking, per ring step
RING_TILE_OPS = 48  # ring attention per (query tile, key tile): scores, mask, log-sum-exp merge; backward
RING_PLAN_OPS = 9  # the host's tile plan per (source, query tile, key tile), once per micro-batch
RING_BLOCK = 1024  # ContextParallelAttention's tile size
EP_OPS = 40  # EP dispatch: sort by expert, count exchange, split sizes, regrouping, in forward and backward
# A step's data-parallel collectives per sharding stage (`ParallelPlan.sharding`), as the runtime issues them:
# (kind, what it moves). FSDP2 gathers each unit's parameters per micro-batch (forward and backward) and
# reduce-scatters its gradients once; `parallel.zero` reduces the whole gradients once after the backward and
# all-gathers the updated slices after the step. tests/ranks/test_zero_ranks.py holds the runtime to it.
SHARDING_COLLECTIVES = {
    "replicate": (("all_reduce", "grads"),),
    "zero1": (("all_reduce", "grads"), ("all_gather", "params")),
    "zero2": (("reduce_scatter", "grads"), ("all_gather", "params")),
    "fsdp": (("all_gather", "params"), ("reduce_scatter", "grads")),
}


class StageTimes(NamedTuple):
    """What one pipeline stage costs. Per step: its ranks' own work on their cores (`device`), and what the
    runtime's wrappers, links and optimizer take (`runtime`; measured together with the ranks, so already
    shared and already waiting for each other)."""

    micro_batch: float  # one micro-batch through the stage (t_s): forward + backward, collectives, sends
    device: float  # per step: compute and host operators over the step's micro-batches
    runtime: float  # per step: wrappers, collectives, sends, FSDP, optimizer
    per_step: float  # once per step, after the micro-batches: FSDP's gradient reduction and the optimizer
    links: float  # per step: the collectives' and sends' share of `runtime`
    micro_batch_links: float  # of `micro_batch`, the collectives' and sends' seconds


@dataclass(frozen=True)
class ExtraWork:
    """Work a stage runs besides its own layers' (the `coupled` layout's encoders on stage 0, built by
    `encoders.coupled_encoder_work`): seconds per micro-batch and per step."""

    compute: float  # per micro-batch, forward + backward on the device
    host: float  # per micro-batch, operators and attention calls
    fsdp_micro_batch: float  # FSDP's gathers and wrappers per micro-batch
    fsdp_step: float  # FSDP's gradient reduction per step
    optimizer: float  # per step
    stage_imbalance: float = 1.0  # the busiest rank's own layers' compute over the mean rank's


@dataclass(frozen=True)
class RingAttention:
    """Ring attention's per-plan costs (the same on every stage)."""

    tile_compute: float  # per layer, forward + backward: one rank's tiles
    layer_host: float  # per layer: the tile loop's operators
    plan_host: float  # per micro-batch: the host's tile plan


def device_seconds(sums: Sums, gpu: GpuSpec, eff: Efficiency, precision: str) -> tuple[float, float]:
    """(per sample, per call) forward seconds of some layers on the device: matmul FLOPs and operands,
    attention (the whole score matrices where the kernel computes them), memory-bound traffic."""
    peak = gpu.compute_flops(precision)
    attn = sums.attn_flops + (sums.causal_attn_flops if eff.attention_full else 0.0)
    mm_bw = eff.matmul_bw or gpu.mem_bw * eff.memory
    elementwise_bw = eff.elementwise_bw or gpu.mem_bw * eff.memory
    per_sample = (
        sums.flops / (peak * eff.matmul)
        + sums.mm_bytes / mm_bw
        + attn / (peak * eff.attention)
        + sums.attn_scores * eff.score_s
        + sums.mem_bytes / elementwise_bw
    )
    return per_sample, sums.mm_weight_bytes / mm_bw


def ring_tiles(workload: Workload, tokens: float, cp: int) -> tuple[float, float]:
    """(tile pairs one rank computes, tile side) of ring attention over `tokens` packed tokens: zig-zag
    chunks of tokens / 2cp cut into tiles of at most RING_BLOCK; a pair is computed when some query sees
    some key in it: the diagonal always, an earlier tile g tiles back when one document spans the gap
    (probability ~ 1 - gap / L_w, L_w = E[L^2]/E[L]: the length of the document a random token is in)."""
    chunk = tokens / (2 * cp)
    side = min(chunk, RING_BLOCK)
    tiles = 2 * cp * math.ceil(chunk / side)  # along the sequence
    doc = workload.doc_span or tokens
    pairs = float(tiles)  # the diagonal
    for gap in range(1, tiles):
        spanned = 1.0 - (gap - 1) * side / doc
        if spanned <= 0:
            break
        pairs += (tiles - gap) * min(1.0, spanned)
    return pairs / cp, side


def ring_attention(terms: PlanTerms) -> RingAttention | None:
    """Ring attention's tiles (None unless the plan's CP is ring attention): per layer, forward + backward,
    QK^T, PV (forward), recomputed QK^T, dV, dP, dQ, dK (backward) on full tiles in fp32, ~20 elementwise
    passes over the tile's scores, the tile loop's operators; the host's tile plan per micro-batch."""
    plan, workload = terms.plan, terms.workload
    if plan.cp <= 1 or plan.cp_kind != "ring":
        return None
    cp, op_s = plan.cp, terms.eff.op_overhead_s
    pairs, side = ring_tiles(workload, terms.tokens, cp)
    heads = workload.shape.n_heads / plan.tp
    tile_compute = pairs * heads * side * side * (14 * workload.head_dim / terms.mm_rate + 20 * 4 * 2 / terms.mem_rate)
    layer_host = (RING_LAYER_OPS + cp * 4 + pairs * RING_TILE_OPS) * op_s
    plan_host = cp * (2 * math.ceil(terms.tokens / (2 * cp) / side)) ** 2 * RING_PLAN_OPS * op_s
    return RingAttention(tile_compute, layer_host, plan_host)


def forward_seconds(terms: PlanTerms, ring: RingAttention | None, st: Sums) -> float:
    """One micro-batch's forward on one rank's device; ring attention replaces the per-document kernel
    (priced by `compute_seconds`), and experts the runtime does not split run on all of a rank's tokens."""
    eff, plan, mb = terms.eff, terms.plan, terms.options.micro_batch
    per_sample, per_call = device_seconds(st, terms.gpu, eff, terms.workload.precision)
    if ring:
        per_sample -= (
            st.attn_flops + (st.causal_attn_flops if eff.attention_full else 0.0)
        ) / terms.attn_rate + st.attn_scores * eff.score_s
    forward = per_sample * mb / terms.split + per_call / plan.tp
    if not eff.split_encoders_experts:  # every TP rank runs the experts on all of its tokens
        forward += st.expert_flops * mb / terms.mm_rate * (1 / plan.cp - 1 / terms.split)
    return forward


def compute_seconds(terms: PlanTerms, ring: RingAttention | None, st: Sums) -> float:
    """A micro-batch's forward + backward (+ recomputation) on the device, ring attention's tiles included."""
    compute = terms.passes * forward_seconds(terms, ring, st)
    if ring:
        compute += st.attn_layers * ring.tile_compute * (1 + terms.recompute / 3)
    return compute


def host_seconds(terms: PlanTerms, ring: RingAttention | None, st: Sums) -> float:
    """A micro-batch's host work: aten operators (a rank runs E / ep experts; EP's dispatch), attention calls
    per document or ring attention's tile loop, Ulysses' all-to-all operators."""
    plan, eff, mb = terms.plan, terms.eff, terms.options.micro_batch
    op_s, ep = eff.op_overhead_s, plan.ep
    ops = st.ops - st.expert_ops * (1 - 1 / ep) + st.sample_ops * mb + (EP_OPS * st.moe_layers if ep > 1 else 0)
    host = ops * op_s * terms.passes / 3
    if ring:
        host += st.attn_layers * ring.layer_host + ring.plan_host
    else:
        host += st.attn_calls * mb * eff.attn_call_s * terms.passes / 3
    if plan.cp > 1 and not ring:
        host += st.attn_layers * 4 * CP_A2A_OPS * op_s * (2 + terms.recompute)
    return host


def tp_seconds(terms: PlanTerms, st: Sums) -> float:
    """TP's all-gather / reduce-scatter pairs (sequence parallel), forward ones mirrored in backward. Where the
    runtime decomposes them into their matmuls (`Efficiency.tp_async`) their volume hides behind the micro-batch's
    matmuls (forward, backward, recomputation), their latency and what exceeds those matmuls stay exposed."""
    tp, eff = terms.plan.tp, terms.eff
    if tp <= 1:
        return 0.0
    per_coll = st.tp_bytes * terms.options.micro_batch / terms.plan.cp / max(st.tp_colls, 1)
    pair = terms.net.time("all_gather", per_coll, tp, tp, 0) + terms.net.time("reduce_scatter", per_coll, tp, tp, 0)
    exposed = (1 - eff.tp_overlap) * st.tp_colls * pair * (2 + terms.recompute) / 2
    if not eff.tp_async:
        return exposed
    latency = terms.net.time("all_gather", 0.0, tp, tp, 0) + terms.net.time("reduce_scatter", 0.0, tp, tp, 0)
    latency *= st.tp_colls * (2 + terms.recompute) / 2
    matmuls = st.flops * terms.options.micro_batch / terms.split / terms.mm_rate * terms.passes
    return latency + max(0.0, exposed - latency - matmuls)


def cp_exchange_seconds(terms: PlanTerms, ring: RingAttention | None, st: Sums) -> float:
    """CP's attention traffic: ring attention's K/V blocks (cp - 1 steps forward and backward, dK/dV
    accumulators cp steps), less what hides behind the tiles; or Ulysses' all-to-alls re-splitting q, k, v
    and the output between tokens and heads, forward and backward."""
    plan, net, workload = terms.plan, terms.net, terms.workload
    cp, layers = plan.cp, st.attn_layers
    if cp <= 1:
        return 0.0
    q_bytes = st.block_io * terms.options.micro_batch / terms.split
    if ring:
        kv = 2 * q_bytes * workload.shape.n_kv_heads / workload.shape.n_heads
        passing = (
            (cp - 1) * (1 + terms.recompute / 3) * 2 * net.time("p2p", kv / layers, 2, terms.split)
            + cp * net.time("p2p", kv * 4 / terms.weight_bytes / layers, 2, terms.split)
        ) * layers
        return max(0.0, passing - terms.eff.cp_overlap * layers * ring.tile_compute)
    heads, kv_heads = workload.shape.n_heads // plan.tp, max(1, workload.shape.n_kv_heads // plan.tp)
    kv_share = math.lcm(kv_heads, cp) / heads  # K/V heads sent (repeated to a multiple of cp) per query head
    forward = 2 * net.time("all_to_all", q_bytes / layers, cp, terms.split) + 2 * net.time(
        "all_to_all", kv_share * q_bytes / layers, cp, terms.split
    )
    return forward * layers * (2 + terms.recompute)


def cp_routing_seconds(terms: PlanTerms, st: Sums) -> float:
    """With CP, MoE's balancing loss sums routing statistics over the sequence's ranks."""
    cp = terms.plan.cp
    if cp <= 1 or not st.moe_layers:
        return 0.0
    return terms.net.time("all_reduce", 4.0 * st.routed_experts, cp, terms.split, 4 * st.moe_layers)


def ep_seconds(terms: PlanTerms, st: Sums) -> float:
    """EP's dispatch / combine all-to-alls (forward and backward) and its routing counts exchange."""
    ep, tp = terms.plan.ep, terms.plan.tp
    if ep <= 1:
        return 0.0
    a2a = st.a2a_bytes * terms.options.micro_batch / terms.ep_split
    return (1 - terms.eff.ep_overlap) * (
        2 * terms.net.time("all_to_all", a2a, ep, tp * ep) * terms.passes / 3
        + terms.net.time("all_to_all", 4.0 * st.routed_experts, ep, tp * ep, st.moe_layers)
    )


def collectives_seconds(terms: PlanTerms, ring: RingAttention | None, st: Sums) -> float:
    """A micro-batch's exposed TP, CP and EP collectives (summed in this order)."""
    return (
        tp_seconds(terms, st)
        + cp_exchange_seconds(terms, ring, st)
        + cp_routing_seconds(terms, st)
        + ep_seconds(terms, st)
    )


def send_seconds(terms: PlanTerms, st: Sums) -> float:
    """The pipeline's sends: activations forward, their gradients back, through every virtual stage."""
    plan, eff = terms.plan, terms.eff
    if plan.pp <= 1:
        return 0.0
    message = st.boundary * terms.options.micro_batch / terms.split
    senders = terms.pipeline_senders_across
    send = terms.net.send(message, bool(senders), senders or 1, calls=0)  # latency: in `pp_microbatch_s`
    return plan.virtual_stages * ((1 - eff.pp_overlap) * 2 * send + eff.pp_microbatch_s)


def rank_params(terms: PlanTerms, st: Sums) -> tuple[float, float]:
    """(dense, expert) parameters of a stage on one rank before FSDP: dense ones split by TP, experts by EP
    (and by TP where the implementation splits them)."""
    tp, eff = terms.plan.tp, terms.eff
    return (
        (st.params - st.expert_params) / tp,
        st.expert_params / (terms.plan.ep * (tp if eff.split_encoders_experts else 1)),
    )


def dp_seconds(terms: PlanTerms, kind: str, nbytes: float, ranks: int, span: int, calls: float) -> tuple[float, float]:
    """A data-parallel collective's (latency, volume) seconds: its latency per unit and call (it waits for
    every rank), and the time its bytes take, of which compute can hide `dp_overlap`."""
    latency = terms.net.time(kind, 0.0, ranks, span, calls)
    return latency, terms.net.time(kind, nbytes, ranks, span, calls) - latency


def exposed_dp_seconds(terms: PlanTerms, kind: str, nbytes: float, ranks: int, span: int, calls: float) -> float:
    """A data-parallel collective's latency and the share of its volume not hidden (`dp_overlap`)."""
    latency, volume = dp_seconds(terms, kind, nbytes, ranks, span, calls)
    return latency + (1 - terms.eff.dp_overlap) * volume


@dataclass(frozen=True)
class FsdpTimes:
    """The data-parallel seconds over a rank's weights. FSDP's over its units: `wrappers` (hooks, copies) per
    micro-batch, the parameter all-gathers per micro-batch (forward and backward) and the gradients' reduction
    once per step, each as (latency, volume): compute can hide some of a volume (`dp_overlap`), never a
    latency. `after`: per step, what nothing hides: a ZeRO stage's reduction after the backward (omni's
    runtime) and its parameters' all-gather after the optimizer's step (`zero_seconds`)."""

    wrappers: float
    gather: tuple[float, float]
    reduce: tuple[float, float]
    after: float = 0.0

    def exposed(self, ov: float) -> tuple[float, float]:
        """(per micro-batch, per step) seconds with `ov` of each volume hidden, whatever compute there is."""
        (gl, gv), (rl, rv) = self.gather, self.reduce
        return self.wrappers + gl + (1 - ov) * gv, rl + (1 - ov) * rv + self.after


NO_FSDP = FsdpTimes(0.0, (0.0, 0.0), (0.0, 0.0))


def _summed(parts: list[tuple[float, float]], times: float = 1.0) -> tuple[float, float]:
    return times * sum(latency for latency, _ in parts), times * sum(volume for _, volume in parts)


def fsdp_seconds(
    terms: PlanTerms, params: float, units: float, tensors: float, expert_params: float, expert_units: float
) -> FsdpTimes:
    """FSDP over a rank's units: each unit's wrapper and its collectives, the parameter all-gathers
    (forward and backward) per micro-batch, the gradients' reduce-scatter (+ HSDP all-reduce) once per step,
    in the last micro-batch's backward. Experts under EP form their own units, sharded over `expert_shards`.
    A ZeRO or replicated stage wraps no unit: `zero_seconds`."""
    if terms.plan.zero:
        return zero_seconds(terms, params + expert_params)
    if not terms.fsdp:
        return NO_FSDP
    plan, eff, wbytes = terms.plan, terms.eff, terms.weight_bytes
    shards, span = terms.shards, terms.rank_span
    all_units = units + expert_units
    gathers = [dp_seconds(terms, "all_gather", params * wbytes, shards, span, units)]
    reduces = [
        dp_seconds(terms, "reduce_scatter", params * eff.grad_bytes, shards, span, units),
        dp_seconds(
            terms,
            "all_reduce",
            params * eff.grad_bytes / shards,
            plan.dp_replicate,
            span * plan.dp_replicate,
            all_units,
        ),
    ]
    if expert_units:
        experts = terms.expert_shards
        gathers.append(dp_seconds(terms, "all_gather", expert_params * wbytes, experts, span, expert_units))
        reduces.append(dp_seconds(terms, "reduce_scatter", expert_params * eff.grad_bytes, experts, span, expert_units))
    return FsdpTimes(all_units * eff.fsdp_unit_s + tensors * eff.fsdp_tensor_s, _summed(gathers, 2.0), _summed(reduces))


def zero_seconds(terms: PlanTerms, params: float) -> FsdpTimes:
    """A ZeRO or replicated stage's collectives over a rank's parameters (`SHARDING_COLLECTIVES`), once per step:
    the gradients all-reduced (ZeRO-2: reduce-scattered) over the shard group, then their share all-reduced over
    dp_replicate; ZeRO-1/2 then all-gather the updated parameters (fp32 where the runtime keeps fp32 parameters
    whole, `Efficiency.zero_master_sharded`). The reduction hides behind the backward only where the runtime
    reduces during it (`Efficiency.zero_reduce_in_backward`); the all-gather follows the step, exposed, unless
    the runtime runs it in the next forward (`zero_gather_in_forward`: hidden like the reduction, in the window
    `hidden_dp_seconds` gives it, the last micro-batch's backward)."""
    plan, eff = terms.plan, terms.eff
    stage, shards, span = plan.sharding, terms.shards, terms.rank_span
    grads = params * eff.grad_bytes
    first = "reduce_scatter" if stage == "zero2" else "all_reduce"
    reduces = [
        dp_seconds(terms, first, grads, shards, span, 1),
        dp_seconds(
            terms,
            "all_reduce",
            grads / (shards if stage == "zero2" else 1),
            plan.dp_replicate,
            span * plan.dp_replicate,
            1,
        ),
    ]
    after = 0.0
    if stage != "replicate":
        weights = terms.weight_bytes if eff.zero_master_sharded else max(terms.weight_bytes, 4)
        gather = dp_seconds(terms, "all_gather", params * weights, shards, span, 1)
        if eff.zero_gather_in_forward:
            reduces.append(gather)
        else:
            after = sum(gather)
    if eff.zero_reduce_in_backward:
        return FsdpTimes(0.0, (0.0, 0.0), _summed(reduces), after)
    return FsdpTimes(0.0, (0.0, 0.0), (0.0, 0.0), after + sum(sum(part) for part in reduces))


def hidden_dp_seconds(terms: PlanTerms, fsdp: FsdpTimes, compute: float) -> tuple[float, float]:
    """(per micro-batch, per step) FSDP seconds a stage pays when only its own compute hides DP traffic: a
    micro-batch's gathers hide behind at most its compute, the step's reduction behind what the gathers left
    of the last micro-batch's backward, each at most `dp_overlap` of its volume."""
    ov = terms.eff.dp_overlap
    (gl, gv), (rl, rv) = fsdp.gather, fsdp.reduce
    hidden_gather = min(ov * gv, compute)
    backward = compute * (terms.passes - 1) / terms.passes
    left = backward * (1 - hidden_gather / compute) if compute else 0.0
    return fsdp.wrappers + gl + gv - hidden_gather, rl + rv - min(ov * rv, left) + fsdp.after


def optimizer_seconds(terms: PlanTerms, params: float, tensors: float) -> float:
    """The optimizer's update and the gradient norm over a rank's parameters: per tensor (plain, or DTensor
    when sharded by FSDP or TP) and per byte."""
    eff = terms.eff
    per_tensor = eff.dtensor_s if terms.fsdp or terms.plan.zero or terms.plan.tp > 1 else eff.tensor_s
    return tensors * per_tensor + params * terms.optimizer_traffic / terms.mem_rate


def param_group_seconds(terms: PlanTerms) -> float:
    """The runtime's AdamW groups parameters by decay and by kind (plain, or DTensors of one mesh): the dense
    model's, TP's (encoders are not split by TP), the experts' under EP; each group costs a foreach call."""
    plan, eff = terms.plan, terms.eff
    sharded = terms.fsdp or plan.zero or plan.tp > 1
    return 2 * (1 + (plan.tp > 1) + (plan.ep > 1)) * (eff.dtensor_group_s if sharded else eff.tensor_group_s)


def weights_seconds(terms: PlanTerms, st: Sums, first: bool) -> tuple[FsdpTimes, float]:
    """(FSDP's times, optimizer per step) of a stage's weights; stage 0 (`first`) also holds the root FSDP
    unit."""
    ep = terms.plan.ep
    dense_params, expert_params = rank_params(terms, st)
    expert_units = st.moe_layers * st.routed_experts / ep if ep > 1 else 0.0
    tensors = st.tensors - st.expert_tensors * (1 - 1 / ep)
    fsdp = fsdp_seconds(
        terms,
        dense_params + (expert_params if ep == 1 else 0.0),
        st.units + first,
        tensors,
        expert_params,
        expert_units,
    )
    steps_slices = terms.fsdp or terms.plan.sharding in ("zero1", "zero2")  # a rank steps its 1/shards
    sharded_params = (dense_params + expert_params) / (terms.shards if steps_slices else 1)
    optimizer = param_group_seconds(terms) + optimizer_seconds(terms, sharded_params, tensors)
    return fsdp, optimizer


def price_stage(
    terms: PlanTerms, ring: RingAttention | None, st: Sums, first: bool, extra: ExtraWork | None = None
) -> StageTimes:
    """One stage's times; `extra`: work it hosts besides its layers. A rank's own work (compute and host,
    profiled on one rank alone) is stretched by the ranks' straggling."""
    compute = compute_seconds(terms, ring, st)
    host = host_seconds(terms, ring, st)
    comm = collectives_seconds(terms, ring, st)
    wrappers = st.tp_modules * terms.eff.tp_module_s if terms.plan.tp > 1 else 0.0
    send = send_seconds(terms, st)
    fsdp, optimizer = weights_seconds(terms, st, first)
    fsdp_micro_batch, fsdp_step = hidden_dp_seconds(terms, fsdp, compute)
    if extra is not None:
        compute = compute * extra.stage_imbalance + extra.compute
        host += extra.host
        fsdp_micro_batch += extra.fsdp_micro_batch
        fsdp_step += extra.fsdp_step
        optimizer += extra.optimizer
    compute, host = compute * terms.straggle, host * terms.straggle
    micro_batches = terms.micro_batches
    links = comm + send + fsdp_micro_batch - fsdp.wrappers
    return StageTimes(
        micro_batch=compute + host + wrappers + comm + send + fsdp_micro_batch,
        device=micro_batches * (compute + host),
        runtime=micro_batches * (wrappers + comm + send + fsdp_micro_batch) + fsdp_step + optimizer,
        per_step=optimizer + fsdp_step,
        links=micro_batches * links + fsdp_step,
        micro_batch_links=links,
    )


def price_stages(
    terms: PlanTerms, groups: tuple[tuple[Sums, int, int], ...], stage0_extra: ExtraWork | None = None
) -> list[StageTimes]:
    """The times of each distinct stage (`pipeline.stage_groups`), stage 0 hosting `stage0_extra`."""
    ring = ring_attention(terms)
    return [price_stage(terms, ring, st, index == 0, stage0_extra if index == 0 else None) for st, index, _ in groups]
