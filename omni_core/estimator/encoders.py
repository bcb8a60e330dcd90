"""An MLLM's encoders (and projectors) in a training step, by the plan's encoder layout (`plan.encoders`).

`coupled` (Megatron-LLaVA): the encoders run on pipeline stage 0 with the LLM's data split, replicated over
TP x CP unless they are split too, on batches nobody rebalanced (`unbalanced_factor`): their work joins
stage 0's (`coupled_encoder_work`, a `stage.ExtraWork`).

`omni` (MegaScale-Omni, DESIGN.md §3), as the runtime executes it (`omni_encoder_seconds`): every rank of the
world is an encoder rank. Each step the items of all data shards are spread over all ranks, longest
processing time first on a cost a*L + b*L^2, so a rank takes its balanced share or the longest item,
whichever is longer; an item over its encoder's threshold (`EncoderSpec.long_tokens` / `long_mb`) is split
over the spec's LSSP group (Ulysses: four all-to-alls per attention layer forward, again in backward). The
`phased` schedule has three phases: the whole step's encoder forward before the LLM, the LLM (1F1B with
pp > 1) on detached embeddings, the encoder backward after it, so no pipeline bubble hides encoder work; the
`joint` schedule runs them per micro-batch in the ranks' idle time and hides `Efficiency.joint_pipeline` of
the bubble. Items' inputs travel from their data
shard's rank to their encoder rank (forward), their embeddings to every stage-0 rank of their shard and the
gradients back (variable-split all-to-alls, `handoff_seconds`). Weights are replicated over the world with one
gradient all-reduce per step, or FSDP-sharded over it (`EncoderSpec.fsdp`: gathered block by block, each block's
forward recomputed in backward).

`disaggregated` (DistTrain): the encoders on `plan.encoders.ranks` ranks of their own, data parallel, no
rebalancing unless the workload says what a step's assignment left (`Workload.encoder_imbalance`); the LLM on
the others (`disaggregated_encoders`; `cost` composes the two sides).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from omni_core.common.catalog import GpuSpec
from omni_core.common.plan import EncoderPlan, ParallelPlan
from omni_core.estimator.communication import SMALL_MESSAGE_BYTES, Network
from omni_core.estimator.pipeline import Sums
from omni_core.estimator.stage import (
    ExtraWork,
    device_seconds,
    exposed_dp_seconds,
    fsdp_seconds,
    optimizer_seconds,
)
from omni_core.estimator.terms import Efficiency, PlanTerms
from omni_core.estimator.workloads import OPTIMIZERS, Workload

MIB = 2**20
ADAM_STATE_BYTES = 18.0  # disaggregated encoder ranks: bf16 weights + fp32 grads, master weights and two moments
GATHERED_BYTES = 4.0  # FSDP-sharded encoders gather their fp32 weights (autocast casts them per call)
METADATA_GATHERS = 2  # the items' metadata: `all_gather_object` gathers its sizes, then the pickled items
INPUT_EXCHANGES = 3  # one inputs all-to-all per input field of a batch (image, video and audio patches / mels)


def encoder_sums(workload: Workload) -> Sums:
    """The encoders' layer totals. Memoised per workload."""
    sums = workload.cache.get("encoder")
    if sums is None:
        sums = workload.cache["encoder"] = Sums.of(workload.encoder)
    return sums


def encoder_of(layer_name: str) -> str:
    """Which encoder of a plan (`EncoderPlan` key) a layer belongs to: the audio encoder and its projector, or
    the vision ones."""
    return "audio" if layer_name.startswith(("audio.", "projector.audio")) else "vision"


def encoder_parts(workload: Workload) -> dict[str, Sums]:
    """Each encoder's layer totals (with its projector), for the settings a plan makes per encoder. Memoised."""
    parts = workload.cache.get("encoder_parts")
    if parts is None:
        keys = dict.fromkeys(encoder_of(layer.name) for layer in workload.encoder)
        parts = workload.cache["encoder_parts"] = {
            key: Sums.of([layer for layer in workload.encoder if encoder_of(layer.name) == key]) for key in keys
        }
    return parts


def embedding_bytes(workload: Workload) -> float:
    """The projected embeddings of one sample ([tokens, llm_dim]): what the encoders hand the LLM."""
    return sum(layer.out_bytes for layer in workload.encoder if layer.name.startswith("projector."))


@functools.cache
def expected_max_normal(n: int) -> float:
    """E[max] of `n` independent standard normals: integral of x n phi(x) Phi(x)^(n-1) over a fine grid (0.56
    for two, 1.03 for four, 2.34 for 64). sqrt(2 ln n), its large-n bound, overstates them: 1.18, 1.67 and 2.88."""
    if n <= 1:
        return 0.0
    step, total = 1e-3, 0.0
    for i in range(-10_000, 10_001):
        x = i * step
        total += (
            x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1)
        )
    return total * step


def unbalanced_factor(cv: float, samples: float, ranks: int) -> float:
    """Without rebalancing, a step waits for the rank that drew the most encoder work: E[max] over `ranks`
    of totals over `samples` samples each, with per-sample spread `cv` (normal totals), mean * (1 +
    cv/sqrt(samples) * E[max of `ranks` standard normals])."""
    if ranks <= 1 or not cv:
        return 1.0
    return 1.0 + cv / math.sqrt(samples) * expected_max_normal(ranks)


def encoder_seconds_per_sample(workload: Workload, gpu: GpuSpec, eff: Efficiency) -> float:
    """Forward seconds of the encoders (and projectors) for one sample's images / clips on one GPU, host
    costs per image and per attention call included (a third of their forward + backward)."""
    if not workload.encoder:
        return 0.0
    enc = encoder_sums(workload)
    return (
        device_seconds(enc, gpu, eff, workload.precision)[0]
        + (enc.attn_calls * eff.attn_call_s + enc.sample_ops * eff.op_overhead_s) / 3
    )


# --- coupled -----------------------------------------------------------------------------------------------


def loaders_imbalance(terms: PlanTerms) -> float:
    """The busiest data rank's whole work (encoders + LLM) over the mean as the loaders leave it
    (`Workload.loader_imbalance`: simulated by the profile, or a drawn step's); 0 when none applies."""
    return terms.workload.loader_imbalance if terms.plan.dp > 1 else 0.0


def coupled_imbalance(terms: PlanTerms) -> float:
    """The `coupled` encoders' work on the rank that drew the most of it over the dp ranks' mean: what the
    loaders leave (`loaders_imbalance`), else an image count's spread (`unbalanced_factor`)."""
    return loaders_imbalance(terms) or unbalanced_factor(
        terms.workload.encoder_cv, terms.micro_batches * terms.options.micro_batch, terms.plan.dp
    )


def coupled_encoder_seconds(terms: PlanTerms, enc: Sums) -> tuple[float, float]:
    """(compute, host) seconds of the encoders per micro-batch on stage 0 (`coupled`): forward + backward
    (+ recomputation) on the micro-batch's samples, on the rank with the most (`coupled_imbalance`)."""
    eff, mb = terms.eff, terms.options.micro_batch
    imbalance = coupled_imbalance(terms)
    per_sample, per_call = device_seconds(enc, terms.gpu, eff, terms.workload.precision)
    compute = (per_sample * mb + per_call) / terms.encoder_split
    host = (enc.ops + enc.sample_ops * mb) * eff.op_overhead_s + enc.attn_calls * mb * eff.attn_call_s
    return terms.passes * compute * imbalance, host * terms.passes / 3


def coupled_encoder_work(terms: PlanTerms) -> ExtraWork | None:
    """The `coupled` encoders' work as stage 0 hosts it (None without encoders): compute and host work per
    micro-batch, their FSDP units (sharded like stage 0) and optimizer."""
    if not terms.workload.encoder:
        return None
    enc = encoder_sums(terms.workload)
    params = enc.params / terms.encoder_split
    fsdp_micro_batch, fsdp_step = fsdp_seconds(terms, params, enc.units, enc.tensors, 0.0, 0.0).exposed(
        terms.eff.dp_overlap
    )
    optimizer = optimizer_seconds(terms, params / (terms.shards if terms.fsdp else 1), enc.tensors)
    compute, host = coupled_encoder_seconds(terms, enc)
    # the loaders' figure is of a rank's whole work: its busiest rank has more of its LLM layers' too
    return ExtraWork(compute, host, fsdp_micro_batch, fsdp_step, optimizer, loaders_imbalance(terms) or 1.0)


# --- the longest item and LSSP ------------------------------------------------------------------------------


def item_length(workload: Workload, work: float) -> float:
    """The length, in mean items of the long-item encoder (`Workload.items`), of an item costing `work` mean
    samples: the positive root of (1 - quad) x + quad x^2 = work / (a mean item's work)."""
    items = workload.items
    if not items.work or work <= 0:
        return 0.0
    target, quad = work / items.work, items.quad
    if quad <= 0:
        return target
    return (-(1 - quad) + math.sqrt((1 - quad) ** 2 + 4 * quad * target)) / (2 * quad)


def long_tokens_threshold(workload: Workload, ranks: int) -> int:
    """The `EncoderSpec.long_tokens` that splits exactly the items longer than one of `ranks` encoder ranks'
    balanced share of the step's encoder work (what balancing cannot even out)."""
    share = item_length(workload, workload.global_batch / ranks) * workload.items.tokens
    return max(1, math.floor(share))


def long_item_group(workload: Workload, encoders: EncoderPlan, work: float | None = None) -> int:
    """The ranks an item costing `work` (default: the workload's longest) runs on: its encoder spec's LSSP
    group when the item is over one of the spec's thresholds (tokens; activation MiB), else 1."""
    items = workload.items
    spec = encoders.spec(items.encoder)
    if spec.lssp == 1 or not items.count:
        return 1
    work = workload.encoder_max_item if work is None else work
    tokens = item_length(workload, work) * items.tokens
    acts = encoder_parts(workload)[items.encoder].act_bytes * long_item_share(workload, 1, work)
    long = (spec.long_tokens and tokens > spec.long_tokens) or (spec.long_mb and acts > spec.long_mb * MIB)
    return spec.lssp if long else 1


def lssp_refusal(workload: Workload, encoders: EncoderPlan, ranks: int) -> str:
    """Why an encoder's LSSP group cannot run on `ranks` encoder ranks, or the long-item encoder's cannot split
    its attention heads (Ulysses), or "". Data without items (text only) splits nothing: a plan with LSSP
    still runs it, so a running job's plan is priced on such a window too."""
    for key in encoder_parts(workload):
        if encoders.spec(key).lssp > ranks:
            return f"encoders.{key}.lssp={encoders.spec(key).lssp} exceeds the {ranks} encoder ranks"
    if not workload.items.count:
        return ""
    key, heads = workload.items.encoder, workload.items.heads
    lssp = encoders.spec(key).lssp
    if heads % lssp:
        return f"encoders.{key}.lssp={lssp} does not divide the {key} encoder's {heads} attention heads"
    return ""


def long_item_share(workload: Workload, group: int, work: float | None = None) -> float:
    """The slice of an item costing `work` (default: the longest) one of its `group` ranks holds, as a share of
    one sample's tokens of its encoder (activations and attention inputs are linear in them); 0 without items."""
    items = workload.items
    work = workload.encoder_max_item if work is None else work
    return item_length(workload, work) / items.count / group if items.count else 0.0


def long_item_seconds(
    workload: Workload, net: Network, passes: float, per_sample: float, group: int, work: float | None = None
) -> float:
    """An item's (costing `work`, default the longest) forward + backward (`passes`, recomputation included)
    over `group` ranks, with Ulysses' four all-to-alls (q, k, v, the output) per attention layer of its encoder
    in forward, recomputed forward and backward when it is split."""
    work = workload.encoder_max_item if work is None else work
    seconds = per_sample * work / group
    if group > 1:
        part = encoder_parts(workload)[workload.items.encoder]
        layer_io = part.block_io * long_item_share(workload, group, work) / max(part.attn_layers, 1)
        seconds += (passes - 1) * 4 * net.time("all_to_all", layer_io, group, group, part.attn_layers)
    return seconds


def step_long_item_seconds(
    workload: Workload, net: Network, passes: float, per_sample: float, encoders: EncoderPlan
) -> float:
    """What a step's longest item takes, expected over steps: no rank can balance it away, and only the steps
    that hold a long item wait for it. The step's items are a Poisson count (items per sample x the batch) of
    the profiled lengths, each on its LSSP group if over the threshold; without lengths (a drawn step), the
    workload's longest."""
    items = workload.items
    if not items.lengths:
        return long_item_seconds(workload, net, passes, per_sample, long_item_group(workload, encoders))
    seconds = []
    for length, share in items.lengths:
        work = items.work * ((1 - items.quad) * length + items.quad * length * length)
        group = long_item_group(workload, encoders, work)
        seconds.append((long_item_seconds(workload, net, passes, per_sample, group, work), share))
    seconds.sort()
    per_step = items.count * workload.global_batch
    # E[max] = sum over ascending values of (step up) x P(some item reaches it), P = 1 - exp(-N x share above)
    expected, below, above = 0.0, 0.0, 1.0
    for value, share in seconds:
        expected += (value - below) * (1 - math.exp(-per_step * above))
        below, above = value, max(above - share, 0.0)
    return expected


# --- omni ----------------------------------------------------------------------------------------------------


def encoder_rounds(terms: PlanTerms) -> int:
    """How often a step runs the encoders: once (phased), or per micro-batch (joint)."""
    return terms.micro_batches if terms.plan.encoders.joint else 1


def omni_weight_seconds(terms: PlanTerms, rounds: int) -> tuple[float, float]:
    """Per step, each encoder's weights over the world: replicated, one gradient all-reduce; FSDP-sharded
    (`EncoderSpec.fsdp`, as `parallel.encoder_shards` runs it), per round and per block an all-gather of its
    fp32 weights in forward and again in backward and a gradient reduce-scatter, with the units' wrappers (the
    stem and projector, gathered once per step, are counted as one more unit). Then the optimizer over the
    rank's share. (seconds, of them the collectives')."""
    plan, eff, world = terms.plan, terms.eff, terms.plan.world_size
    seconds = links = 0.0
    for key, st in encoder_parts(terms.workload).items():
        if plan.encoders.spec(key).fsdp:
            gather = exposed_dp_seconds(terms, "all_gather", st.params * GATHERED_BYTES, world, world, st.units)
            reduce = exposed_dp_seconds(terms, "reduce_scatter", st.params * eff.grad_bytes, world, world, st.units)
            links += rounds * (2 * gather + reduce)
            seconds += rounds * (st.units * eff.fsdp_unit_s + st.tensors * eff.fsdp_tensor_s) + optimizer_seconds(
                terms, st.params / world, st.tensors
            )
        else:
            links += exposed_dp_seconds(terms, "all_reduce", st.params * eff.grad_bytes, world, world, 1)
            seconds += optimizer_seconds(terms, st.params, st.tensors)
    return seconds + links, links


def encoder_state_bytes(part: Sums, state_bytes: float, grad_bytes: float, ranks: int, sharded: bool) -> float:
    """An encoder's model states on one of its `ranks`: whole when replicated; FSDP-sharded, its share plus
    the full fp32 weights and gradients of one unit gathered at a time (`parallel.encoder_shards`: a block, or
    the stem and projector), taken as the encoder's mean unit."""
    if not sharded:
        return part.params * state_bytes
    return part.params * state_bytes / ranks + part.params / max(part.units, 1.0) * (GATHERED_BYTES + grad_bytes)


def sharded_recompute_share(workload: Workload, plan: EncoderPlan) -> float:
    """The share of the encoders' compute whose blocks recompute their forward in backward: the sharded
    encoders' (`parallel.encoder_shards` checkpoints each block it gathers)."""
    parts, total = encoder_parts(workload), encoder_sums(workload).flops
    return sum(st.flops for key, st in parts.items() if plan.spec(key).fsdp) / total if total else 0.0


def handoff_seconds(workload: Workload, plan: ParallelPlan, net: Network, items: float) -> float:
    """The collectives `parallel.encoders.EncoderStep` issues over the world each step: the items' metadata
    (`all_gather_object`: its sizes, then the descriptions; small, so their latency), one all-to-all per input
    field (`INPUT_EXCHANGES`, issued empty too: every rank calls every collective) carrying a data shard's raw
    inputs out to their encoder ranks, the embeddings in to the consumers (every TP rank the full rows of its
    CP share) and their gradients back (mirrored). `items`: what the busiest rank sends or receives."""
    world = plan.world_size
    metadata = net.time("all_gather", SMALL_MESSAGE_BYTES, world, world, METADATA_GATHERS)
    inputs = net.time("all_to_all", items * workload.items.input_bytes, world, world) + net.time(
        "all_to_all", 0.0, world, world, INPUT_EXCHANGES - 1
    )
    embeddings = net.time("all_to_all", items * embedding_bytes(workload) / plan.cp, world, world)
    return metadata + inputs + 2 * embeddings


class OmniEncoderTimes(NamedTuple):
    """The `omni` encoders' side of a step (`omni_encoder_seconds`)."""

    exposed: float  # what the step pays for them
    long_item: float  # their longest item's seconds
    handoff: float  # the handoff's all-to-alls
    links: float  # every collective of theirs: the handoff's and the weights'


def omni_encoder_seconds(terms: PlanTerms, bubble: float) -> OmniEncoderTimes:
    """The encoders in the `omni` layout: a rank's balanced share of the step's items or its longest item,
    whichever is longer; the encoders' operators per round; their weights (`omni_weight_seconds`); the
    handoff; less the share of the pipeline's `bubble` a joint schedule fills with them (joint; none when
    phased)."""
    workload, plan, eff = terms.workload, terms.plan, terms.eff
    passes = max(terms.passes, 3.0 + sharded_recompute_share(workload, plan.encoders))
    per_sample = passes * encoder_seconds_per_sample(workload, terms.gpu, eff) * terms.straggle
    balanced = per_sample * workload.global_batch / plan.world_size
    long_item = step_long_item_seconds(workload, terms.net, passes, per_sample, plan.encoders)
    rounds = encoder_rounds(terms)
    handoff = handoff_seconds(workload, plan, terms.net, workload.global_batch / plan.dp)  # a shard's items
    weights, weight_links = omni_weight_seconds(terms, rounds)
    operators = encoder_sums(workload).ops * eff.op_overhead_s * passes / 3 * rounds
    seconds = max(balanced, long_item) + operators + weights + handoff
    filled = eff.joint_pipeline * bubble if plan.encoders.joint else 0.0
    return OmniEncoderTimes(max(seconds - filled, 0.0), long_item, handoff, handoff + weight_links)


def omni_encoder_bytes(terms: PlanTerms) -> float:
    """The `omni` encoders' bytes on every rank: each encoder's states (`encoder_state_bytes`), the
    activations of the rank's share of the items in flight (the whole step's under three phases, a
    micro-batch's under the joint schedule) or of its slice of the longest item, whichever is larger."""
    workload, plan = terms.workload, terms.plan
    enc, world = encoder_sums(workload), plan.world_size
    states = sum(
        encoder_state_bytes(st, terms.state_bytes, terms.eff.grad_bytes, world, plan.encoders.spec(key).fsdp)
        for key, st in encoder_parts(workload).items()
    )
    share = 1.0 if terms.options.checkpoint else sharded_recompute_share(workload, plan.encoders)
    acts = share * (enc.out_bytes + enc.max_act) + (1 - share) * enc.act_bytes
    in_flight = max(
        workload.global_batch / world / encoder_rounds(terms),
        long_item_share(workload, long_item_group(workload, plan.encoders)),
    )  # samples' activations
    return states + acts * in_flight * (1 + terms.eff.workspace_frac)


# --- disaggregated -------------------------------------------------------------------------------------------


class EncoderRanks(NamedTuple):
    """The `disaggregated` encoders' side of a step (`disaggregated_encoders`)."""

    seconds: float  # the encoder ranks' forward + backward of the step, gradient all-reduce included
    handoff: float  # embeddings to the LLM ranks and their gradients back
    peak_bytes: float
    reason: str = ""  # why they do not fit ("" when they do)


def disaggregated_encoders(
    workload: Workload, gpu: GpuSpec, plan: ParallelPlan, eff: Efficiency, gpus_per_node: int
) -> EncoderRanks:
    """The encoders on their `plan.encoders.ranks` ranks: pure data parallel on unbalanced batches, no rank
    done before the longest item (split over its LSSP group when long); weights replicated, or sharded over
    the encoder ranks (`EncoderSpec.fsdp`), gradients all-reduced, the encoders' operators and an optimizer
    step of their own; activation checkpointing when the full activations do not fit. Inputs, embeddings and
    their gradients cross between the two sides by the `omni` layout's collectives (`handoff_seconds`)."""
    ranks = plan.encoders.ranks
    refusal = lssp_refusal(workload, plan.encoders, ranks)
    if refusal:
        return EncoderRanks(math.inf, 0.0, math.inf, refusal)
    enc, per_rank = encoder_sums(workload), workload.global_batch / ranks
    states = sum(
        encoder_state_bytes(st, ADAM_STATE_BYTES, eff.grad_bytes, ranks, plan.encoders.spec(key).fsdp)
        for key, st in encoder_parts(workload).items()
    )
    group = long_item_group(workload, plan.encoders)
    in_flight = max(min(per_rank, 1.0), long_item_share(workload, group))  # samples' activations at once
    share = sharded_recompute_share(workload, plan.encoders)  # sharded blocks recompute in any case
    full = share * (enc.out_bytes + enc.max_act) + (1 - share) * enc.act_bytes
    # (peak bytes, passes) without checkpointing, then with it (it recomputes forward): the first that fits
    options = [
        (states + act * in_flight * (1 + eff.workspace_frac), passes)
        for act, passes in ((full, 3 + share), (enc.out_bytes + enc.max_act, 4))
    ]
    fitting = [(peak, passes) for peak, passes in options if peak <= gpu.usable_bytes]
    if not fitting:
        peak = options[-1][0]
        return EncoderRanks(
            math.inf,
            0.0,
            peak,
            f"out of memory on the {ranks} encoder ranks: {peak / 1e9:.1f} GB "
            f"needed ({states / 1e9:.1f} GB encoder states) > {gpu.usable_bytes / 1e9:.1f} GB usable",
        )
    peak, passes = fitting[0]
    net = Network(gpu, gpus_per_node, eff.link, eff.collectives)
    per_sample = passes * encoder_seconds_per_sample(workload, gpu, eff)
    imbalance = workload.encoder_imbalance or unbalanced_factor(workload.encoder_cv, max(per_rank, 1.0), ranks)
    balanced = per_sample * per_rank * imbalance
    longest = step_long_item_seconds(workload, net, passes, per_sample, plan.encoders)
    sharded = sum(st.params for key, st in encoder_parts(workload).items() if plan.encoders.spec(key).fsdp)
    reduce = (1 - eff.dp_overlap) * (
        net.time("all_reduce", enc.params * eff.grad_bytes, ranks, ranks)  # = RS + AG
        + net.time("all_gather", sharded * GATHERED_BYTES, ranks, ranks)
    )  # backward's
    # the busier side of the handoff: an encoder rank's items, or a data shard's
    ship = handoff_seconds(workload, plan, net, workload.global_batch / min(ranks, plan.dp))
    host = enc.ops * eff.op_overhead_s * passes / 3  # the encoders' operators, once per step
    straggle = eff.straggle if ranks > 1 else 1.0
    update = encoder_update_seconds(workload, gpu, plan.encoders, eff, ranks)
    return EncoderRanks((max(balanced, longest) + host) * straggle + reduce + update, ship, peak)


def encoder_update_seconds(
    workload: Workload, gpu: GpuSpec, encoders: EncoderPlan, eff: Efficiency, ranks: int
) -> float:
    """The disaggregated encoder ranks' optimizer step over their encoders' weights (a rank's share of a
    sharded encoder's, DTensors), per tensor and per byte (as `stage.optimizer_seconds` prices the LLM's),
    and its parameter groups (decay and no decay)."""
    traffic = eff.optimizer_bytes_per_param * OPTIMIZERS[workload.optimizer][1]
    seconds = 2 * eff.tensor_group_s
    for key, st in encoder_parts(workload).items():
        sharded = encoders.spec(key).fsdp and ranks > 1
        seconds += st.tensors * (eff.dtensor_s if sharded else eff.tensor_s) + st.params / (
            ranks if sharded else 1
        ) * traffic / (gpu.mem_bw * eff.memory)
    return seconds
