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
               + the pipeline's sends; `coupled` encoders: their work on stage 0 (imbalanced batches)
    + per step: FSDP's gradient reduce-scatter (after the last micro-batch); under a ZeRO stage the gradients'
      all-reduce (ZeRO-2: reduce-scatter) and the updated parameters' all-gather (`stage.zero_seconds`)
    + per step: optimizer and gradient norm (per parameter group and tensor, plain or DTensor, + bytes), the step's
      small synchronising all-reduces, host work outside the model (`step_overhead_s`: data loading)
    + `omni` encoders: on every rank, balanced, long items split over LSSP groups, before and after the LLM
      (three phases), with their weights' collectives and the inputs' and embeddings' handoff (`encoders`)
    `disaggregated` encoders: the step is the slower of the LLM on its ranks (the above without encoders) and
    the encoders on theirs, plus shipping the embeddings between them

The plan says where the encoders run (`ParallelPlan.encoders`: layout, per encoder LSSP group, long-item
threshold, weight sharding): the estimate prices the plan object the runtime executes.

Collectives use an alpha-beta model per link class and per collective kind: a group whose ranks lie in one
node uses the intra-node link, otherwise the inter-node one. When a node has fewer compute units than
ranks (CPU "devices": processes sharing cores, `GpuSpec.cores`), the ranks' host and compute work is
time-shared: a rank runs whole on the core it started on and one waiting in a collective lends its core, so
the step is at least the fullest core's work (`fullest_core_seconds`: the longest rank's with its
core-mates'), the `omni` encoders' phase too; a GPipe or 1F1B pipeline is simulated pass by pass with its
busy ranks sharing the cores (a waiting stage lends its own); ranks of a CPU
node also share its memory bandwidth (`Efficiency.shared_memory`). Memory per GPU: weights, gradients
and AdamW states (what the plan's sharding stage shards divided by dp_shard x cp, copied over dp_replicate:
`memory.param_state_bytes`), activations of the
micro-batches in flight (only layer outputs with checkpointing), workspace. Every assumption that is a
choice (overlaps, efficiencies, overheads, what the implementation splits) lives in `Efficiency`.

`estimate_step` composes the parts, each a module: `terms` (the inputs, `Efficiency` and `Options`, and what
they imply), `memory` (bytes per GPU), `stage` (t_s), `pipeline` (stages and the pipeline's formula),
`encoders` (the encoders' terms by layout), `communication` (the alpha-beta model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from omni_core.common.catalog import GpuSpec
from omni_core.common.plan import EncoderPlan, ParallelPlan
from omni_core.estimator.communication import SMALL_MESSAGE_BYTES, Network
from omni_core.estimator.encoders import (
    OmniEncoderTimes,
    coupled_encoder_work,
    coupled_imbalance,
    disaggregated_encoders,
    lssp_refusal,
    omni_encoder_seconds,
)
from omni_core.estimator.memory import out_of_memory, peak_memory
from omni_core.estimator.pipeline import (
    pipeline_seconds,
    schedule_refusal,
    stage_group_positions,
    stage_groups,
    time_shared_pipeline,
)
from omni_core.estimator.stage import StageTimes, price_stages
from omni_core.estimator.terms import Efficiency, Options, PlanTerms
from omni_core.estimator.workloads import EncoderItems, Workload

__all__ = ["COLLECTIVES", "Efficiency", "Estimate", "Options", "estimate_step"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")  # the kinds `Efficiency.collectives` scales
SYNC_COLLECTIVES = 2  # the step's all-reduces of its loss and token statistics
# TP: the gradient norm's full tensors (row- and column-sharded groups) and the one reduction of the replicated
# weights' partial gradients (`runtime.gradients.replicate_partial_grads`)
TP_SYNC_COLLECTIVES = 3
DEFAULT_EFFICIENCY = Efficiency()  # the catalogue's efficiencies (frozen: one instance serves every call)


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


def batch_refusal(workload: Workload, plan: ParallelPlan, options: Options) -> str:
    """Why the step's batch cannot run through `plan` in micro-batches of `options.micro_batch` (it does not
    divide over DP, or the pipeline schedule refuses their number), or why its `omni` encoders' LSSP group
    cannot split the longest item over the world, or ""."""
    dp, mb = plan.dp, options.micro_batch
    micro_batches, rest = divmod(workload.global_batch, dp * mb)  # per step per pipeline
    if rest:
        return f"global_batch={workload.global_batch} is not divisible by dp={dp} x micro_batch={mb}"
    if plan.encoders.layout == "omni" and workload.encoder:
        refusal = lssp_refusal(workload, plan.encoders, plan.world_size)
        if refusal:
            return refusal
    return schedule_refusal(plan, micro_batches)


def sync_seconds(terms: PlanTerms) -> float:
    """The step's small synchronising all-reduces over the world: loss and token statistics, FSDP's, TP's
    (`TP_SYNC_COLLECTIVES`), EP's and the pipeline's."""
    plan = terms.plan
    syncs = (
        SYNC_COLLECTIVES
        + (1 if terms.fsdp else 0)
        + TP_SYNC_COLLECTIVES * (plan.tp > 1)
        + (plan.ep > 1)
        + (plan.pp > 1)
    )
    return terms.net.time("all_reduce", SMALL_MESSAGE_BYTES, plan.world_size, plan.world_size, syncs)


def fullest_core_seconds(longest: float, others: float, ranks: int, cores: int) -> float:
    """Seconds until `ranks` ranks time-sharing `cores` cores have all done their work between two of the
    step's collectives, one rank `longest` seconds of it and the others `others` each on average: each rank
    runs whole on one core, the ranks spread as evenly as their count allows (a core holds ceil(ranks /
    cores) or floor of it) but at random, and the collective waits for the fullest core: the longest rank's
    with its core-mates', or another core's, expected over the placements. Four ranks on two cores take
    longest + others; three, longest + others two times in three, else max(longest, 2 x others); balanced
    ranks, ceil(ranks / cores) rounds.

    Measured (issue #49; gloo on 2 cores, ranks busy k x 20 ms in a matmul loop, then an all-reduce,
    all-gather, all-to-all or barrier): a rank waiting for a late peer sleeps (its CPU time in the collective
    is the collective's own, 0.5-4 ms, over 20-57 ms of waiting) and lends its core, yet a busy rank keeps the
    core it started on. Beyond the collective alone, 4 ranks of 2, 1, 1, 1 units took 2.8-3.2 units (this
    rule 3, their total over the cores 2.5), of 3, 1, 1, 1: 3.7-3.9 (4; 3), of 2, 2, 1, 1: 3.4 (3.33; 3);
    3 balanced ranks 1.7-2.0 (2; 1.5), 3 of 2, 1, 1: 2.3-2.6 (2.67; 2); 1 busy rank of 3 or 4: 1.0 (1)."""
    per_core, spare = divmod(ranks, cores)  # `spare` cores hold one rank more
    crowded = spare * (per_core + 1) / ranks  # the chance that the longest rank lands on one of those
    on_crowded = max(longest + per_core * others, (per_core + (spare >= 2)) * others)
    on_plain = max(longest + (per_core - 1) * others, (per_core + (spare >= 1)) * others)
    return crowded * on_crowded + (1 - crowded) * on_plain


def shared_ranks(terms: PlanTerms) -> int:
    """How many ranks time-share a node's cores (`GpuSpec.cores`), or 0 when every rank has a core of its own."""
    ranks = min(terms.plan.world_size, terms.gpus_per_node)
    return ranks if terms.gpu.cores and ranks > terms.gpu.cores else 0


def shared_cores_seconds(terms: PlanTerms, stages: list[StageTimes], counts: list[int], spread: float) -> float:
    """The least the LLM's part of a step takes when a node's ranks time-share fewer cores (0 when every rank
    has its own): each rank's work on a core (device, wrappers, and of the links' seconds the share a
    collective keeps its rank's process on a core, `Efficiency.link_cpu_share`: its copies and reductions; the
    rest is waiting, on no core), placed on the cores as `fullest_core_seconds` says. A stage's priced work is
    its busiest rank's; `spread` is what that rank does beyond its stage's mean (the `coupled` encoders'
    share of the unbalanced batches), so that the longest rank shares its core with ranks of mean work."""
    ranks = shared_ranks(terms)
    if not ranks:
        return 0.0
    idle = 1.0 - terms.eff.link_cpu_share
    work = [times.device + times.runtime - idle * times.links + terms.eff.step_overhead_s for times in stages]
    longest = max(work)
    mean = (sum(seconds * count for seconds, count in zip(work, counts)) - spread) / terms.plan.pp
    return fullest_core_seconds(longest, (ranks * mean - longest) / (ranks - 1), ranks, terms.gpu.cores)


def shared_encoder_seconds(terms: PlanTerms, encoder: float, links: float) -> float:
    """The `omni` encoders' exposed seconds (`encoder`, balanced over the ranks, `links` of them their
    collectives: the handoff's and the weights') on a node's time-shared cores: their work in rounds
    (`fullest_core_seconds`), the collectives' waiting (their idle share, as the LLM's in
    `shared_cores_seconds`) on no core; `encoder` where every rank has a core. Measured (issue #49,
    layout_bench's data): dp4+omni's encoder phase at world 4 on 2 cores took 0.37-0.50 s, as long as
    dp2+omni's at world 2 (0.26-0.48 s) with twice the items per rank."""
    ranks = shared_ranks(terms)
    if not ranks:
        return encoder
    waiting = min((1.0 - terms.eff.link_cpu_share) * links, encoder)
    work = encoder - waiting
    return fullest_core_seconds(work, work, ranks, terms.gpu.cores) + waiting


def time_shared_pipeline_seconds(terms: PlanTerms, stages: list[StageTimes], per_step: float) -> float:
    """A GPipe or 1F1B pipeline whose node's ranks time-share fewer cores, simulated pass by pass
    (`pipeline.time_shared_pipeline`): a stage waiting for its input lends its core, and busy stages share
    them; then the per-step work (`per_step` on a core of its own), every rank's at once. 0 where ranks have
    cores of their own, without a pipeline or interleaved (the bound `shared_cores_seconds` stands alone
    there)."""
    gpu, plan = terms.gpu, terms.plan
    ranks_per_node = shared_ranks(terms)
    if not ranks_per_node or plan.pp == 1 or plan.pp_schedule == "Interleaved1F1B":
        return 0.0
    idle = 1.0 - terms.eff.link_cpu_share
    work = [
        (times.micro_batch - idle * times.micro_batch_links, idle * times.micro_batch_links)
        for times in (stages[g] for g in stage_group_positions(terms.workload, plan.pp))
    ]
    pipeline = time_shared_pipeline(
        plan.pp_schedule, terms.micro_batches, work, 1 / terms.passes, ranks_per_node / plan.pp, gpu.cores
    )
    return pipeline + per_step * ranks_per_node / gpu.cores + terms.eff.step_overhead_s


def estimate_step(
    workload: Workload,
    gpu: GpuSpec,
    plan: ParallelPlan,
    options: Options,
    *,
    gpus_per_node: int,
    eff: Efficiency = DEFAULT_EFFICIENCY,
) -> Estimate:
    """Step time and peak memory of `plan` (its world = the Cell's GPUs), its encoders where `plan.encoders`
    puts them. Never raises for a plan that does not fit: the Estimate's `reason` says why (memory, batch
    split)."""
    if plan.encoders.layout == "disaggregated":
        return disaggregated_step(workload, gpu, plan, options, gpus_per_node=gpus_per_node, eff=eff)
    est = Estimate(plan, options)
    est.reason = batch_refusal(workload, plan, options)
    if est.reason:
        est.peak_mem_bytes = math.inf  # not a memory problem: never the "closest to fitting" plan
        return est
    terms = PlanTerms.of(workload, gpu, plan, options, eff, gpus_per_node)
    groups = stage_groups(workload, plan.pp)
    est.peak_mem_bytes, worst = peak_memory(terms, groups)  # first: most plans of a large model do not fit
    if est.peak_mem_bytes > gpu.usable_bytes:
        est.reason = out_of_memory(est.peak_mem_bytes, worst, gpu)
        return est

    omni = plan.encoders.layout == "omni"
    coupled = None if omni else coupled_encoder_work(terms)
    stages = price_stages(terms, groups, coupled)
    counts = [count for _, _, count in groups]
    pipeline, bubble = pipeline_seconds(plan, terms.micro_batches, [times.micro_batch for times in stages], counts)
    no_encoders = OmniEncoderTimes(0.0, 0.0, 0.0, 0.0)
    omni_times = omni_encoder_seconds(terms, bubble) if omni and workload.encoder else no_encoders
    encoder = omni_times.exposed
    per_step = max(times.per_step for times in stages)
    sync = sync_seconds(terms)
    step = pipeline + per_step + encoder + sync + terms.eff.step_overhead_s
    # the `coupled` encoders' rank with the most work: what it does beyond its stage's mean
    spread = terms.micro_batches * coupled.compute * (1 - 1 / coupled_imbalance(terms)) if coupled else 0.0
    shared = max(
        shared_cores_seconds(terms, stages, counts, spread), time_shared_pipeline_seconds(terms, stages, per_step)
    )
    step = max(step, shared + shared_encoder_seconds(terms, encoder, omni_times.links) + sync)

    est.step_time_s = step
    est.samples_per_s = workload.global_batch / step
    est.breakdown = {
        "pipeline_s": pipeline,
        "bubble_s": bubble,
        "encoder_s": encoder,
        "encoder_long_item_s": omni_times.long_item,
        "encoder_handoff_s": omni_times.handoff,
        "optimizer_s": per_step,
        "sync_s": sync,
        "host_s": terms.eff.step_overhead_s,
        "device_s": stages[0].device * counts[0],
        "runtime_s": stages[0].runtime * counts[0],
        **worst,
    }
    return est


def llm_only(workload: Workload) -> Workload:
    """The workload without its encoders: what a `disaggregated` plan's LLM ranks run. Memoised."""
    llm = workload.cache.get("llm_only")
    if llm is None:
        llm = workload.cache["llm_only"] = replace(
            workload, encoder=(), encoder_cv=0.0, encoder_max_item=0.0, items=EncoderItems(), cache={}
        )
    return llm


def world_sync_seconds(gpu: GpuSpec, plan: ParallelPlan, gpus_per_node: int, eff: Efficiency) -> float:
    """What a `disaggregated` step's small all-reduces cost beyond the LLM-only estimate's: the loss and token
    statistics span the whole world (the encoder ranks too), not the LLM's ranks, and the gradient norm adds
    one all-reduce joining the two sides' halves (`runtime.gradients.clip_grad_norm`)."""
    net, world, llm = Network(gpu, gpus_per_node, eff.link, eff.collectives), plan.world_size, plan.llm_world_size
    return net.time("all_reduce", SMALL_MESSAGE_BYTES, world, world, SYNC_COLLECTIVES + 1) - net.time(
        "all_reduce", SMALL_MESSAGE_BYTES, llm, llm, SYNC_COLLECTIVES
    )


def disaggregated_step(
    workload: Workload, gpu: GpuSpec, plan: ParallelPlan, options: Options, *, gpus_per_node: int, eff: Efficiency
) -> Estimate:
    """A `disaggregated` plan: the LLM's plan on its ranks and the encoders on theirs, one after the other
    within the step (phased), or overlapped as DistTrain pipelines them (joint: `Efficiency.disaggregated_overlap`
    of the shorter side's (m - 1) / m), plus the embeddings' handoff; memory is the fuller side's."""
    llm = estimate_step(
        llm_only(workload), gpu, replace(plan, encoders=EncoderPlan()), options, gpus_per_node=gpus_per_node, eff=eff
    )
    est = Estimate(plan, options, peak_mem_bytes=llm.peak_mem_bytes, reason=llm.reason)
    if not llm.fits or not workload.encoder:
        est.step_time_s, est.samples_per_s, est.breakdown = llm.step_time_s, llm.samples_per_s, llm.breakdown
        return est
    encoders = disaggregated_encoders(workload, gpu, plan, eff, gpus_per_node)
    est.peak_mem_bytes, est.reason = max(llm.peak_mem_bytes, encoders.peak_bytes), encoders.reason
    if est.fits:
        micro = max(1, workload.global_batch // (plan.dp * options.micro_batch)) if plan.encoders.joint else 1
        hidden = eff.disaggregated_overlap * min(encoders.seconds, llm.step_time_s) * (1 - 1 / micro)
        sync = world_sync_seconds(gpu, plan, gpus_per_node, eff)
        est.step_time_s = encoders.seconds + llm.step_time_s - hidden + encoders.handoff + sync
        est.samples_per_s = workload.global_batch / est.step_time_s
        est.breakdown = {
            **llm.breakdown,
            "llm_s": llm.step_time_s,
            "encoder_s": encoders.seconds,
            "encoder_handoff_s": encoders.handoff,
            "sync_s": llm.breakdown["sync_s"] + sync,
        }
    return est
