"""An MLLM's encoders (and projectors) in a training step, by layout.

`coupled` (Megatron-LLaVA): the encoders run on pipeline stage 0 with the LLM's data split, replicated over
TP x CP unless they are split too, on batches nobody rebalanced (`unbalanced_factor`): their work joins
stage 0's (`encoder_work`, a `stage.ExtraWork`). `omni` (MegaScale-Omni, DESIGN.md §3): on every rank, data
parallel over the world and balanced by grouped reordering, except that no rank finishes before the longest
item (image, clip) it got, which LSSP splits over `Options.lssp` ranks; the joint encoder-LLM schedule
places their work in the pipeline's bubbles (`Efficiency.joint_pipeline` of them): `omni_encoder_seconds`.
"""

from __future__ import annotations

import math

from omni_core.common.catalog import GpuSpec
from omni_core.estimator.pipeline import Sums
from omni_core.estimator.stage import ExtraWork, device_seconds, fsdp_seconds, optimizer_seconds
from omni_core.estimator.terms import Efficiency, PlanTerms
from omni_core.estimator.workloads import Workload


def encoder_sums(workload: Workload) -> Sums:
    """The encoders' layer totals. Memoised per workload."""
    sums = workload.cache.get("encoder")
    if sums is None:
        sums = workload.cache["encoder"] = Sums.of(workload.encoder)
    return sums


def unbalanced_factor(cv: float, samples: float, ranks: int) -> float:
    """Without rebalancing, a step waits for the rank that drew the most encoder work: E[max] over `ranks`
    of totals over `samples` samples each, with per-sample spread `cv`, ~ mean * (1 + cv/sqrt(samples) *
    sqrt(2 ln ranks))."""
    if ranks <= 1 or not cv:
        return 1.0
    return 1.0 + cv / math.sqrt(samples) * math.sqrt(2 * math.log(ranks))


def encoder_seconds_per_sample(workload: Workload, gpu: GpuSpec, eff: Efficiency) -> float:
    """Forward seconds of the encoders (and projectors) for one sample's images / clips on one GPU, host
    costs per image and per attention call included (a third of their forward + backward)."""
    if not workload.encoder:
        return 0.0
    enc = encoder_sums(workload)
    return (device_seconds(enc, gpu, eff, workload.precision)[0]
            + (enc.attn_calls * eff.attn_call_s + enc.sample_ops * eff.op_overhead_s) / 3)


def coupled_encoder_seconds(terms: PlanTerms, enc: Sums) -> tuple[float, float]:
    """(compute, host) seconds of the encoders per micro-batch on stage 0 (`coupled`): forward + backward
    (+ recomputation) on the micro-batch's samples, stretched by the unbalanced batches of dp ranks."""
    eff, mb, plan = terms.eff, terms.options.micro_batch, terms.plan
    imbalance = unbalanced_factor(terms.workload.encoder_cv, terms.micro_batches * mb, plan.dp)
    per_sample, per_call = device_seconds(enc, terms.gpu, eff, terms.workload.precision)
    compute = (per_sample * mb + per_call) / terms.encoder_split
    host = (enc.ops + enc.sample_ops * mb) * eff.op_overhead_s + enc.attn_calls * mb * eff.attn_call_s
    return terms.passes * compute * imbalance, host * terms.passes / 3


def encoder_work(terms: PlanTerms) -> ExtraWork | None:
    """The encoders' per-rank work as a stage would host it (None without encoders): their FSDP units and
    optimizer in both layouts; their compute and host work per micro-batch only `coupled` (`omni` prices
    those over the world: `omni_encoder_seconds`)."""
    if not terms.workload.encoder:
        return None
    enc = encoder_sums(terms.workload)
    params = enc.params / terms.encoder_split
    fsdp_micro_batch, fsdp_step = fsdp_seconds(terms, params, enc.units, enc.tensors, 0.0, 0.0)
    optimizer = optimizer_seconds(terms, params / (terms.shards if terms.fsdp else 1), enc.tensors)
    compute = host = 0.0
    if terms.options.layout == "coupled":
        compute, host = coupled_encoder_seconds(terms, enc)
    return ExtraWork(compute, host, fsdp_micro_batch, fsdp_step, optimizer)


def long_item_seconds(terms: PlanTerms, enc: Sums, per_sample: float) -> float:
    """The longest item's forward + backward, split over `lssp` ranks with Ulysses (all-to-alls of q, k, v
    and the output in every encoder layer)."""
    lssp, max_item = terms.options.lssp, terms.workload.encoder_max_item
    seconds = per_sample * max_item / lssp
    if lssp > 1:
        item_io = enc.block_io * max_item / lssp
        seconds += (2 + terms.recompute) * 4 * terms.net.time(
            "all_to_all", item_io / max(enc.attn_layers, 1), lssp, lssp, enc.attn_layers)
    return seconds


def omni_encoder_seconds(terms: PlanTerms, work: ExtraWork, bubble: float) -> tuple[float, float]:
    """(exposed, longest item) seconds of the encoders in the `omni` layout: a rank's balanced share of the
    step's samples or its longest item, whichever is longer, plus the encoders' operators and FSDP per
    micro-batch (FSDP reduces their gradients once per step) and optimizer, less the share of the pipeline's
    `bubble` the joint schedule fills with them."""
    workload, plan, eff = terms.workload, terms.plan, terms.eff
    enc = encoder_sums(workload)
    per_sample = terms.passes * encoder_seconds_per_sample(workload, terms.gpu, eff) * terms.straggle
    balanced = per_sample * workload.global_batch / plan.world_size
    long_item = long_item_seconds(terms, enc, per_sample)
    seconds = max(balanced, long_item)
    seconds += ((enc.ops * eff.op_overhead_s * terms.passes / 3 + work.fsdp_micro_batch) * terms.micro_batches
                + work.fsdp_step + work.optimizer)
    return max(seconds - eff.joint_pipeline * bubble, 0.0), long_item
