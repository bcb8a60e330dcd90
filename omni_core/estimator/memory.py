"""Bytes per GPU, checked before any time is priced: most candidate plans of a large model do not fit, and
that is cheap to find out.

Per pipeline stage: model states (weights, gradients and AdamW states, as much of them divided by the shard
group dp_shard x cp as the plan's sharding stage shards, `param_state_bytes`; copied over dp_replicate; experts
over their own shards), FSDP's largest unit's gathered weights, the
activations of the micro-batches in flight (only layer outputs with checkpointing) and a workspace share of
them. The encoders add theirs on stage 0 (`coupled`) or on every rank (`omni`: the rank's share of the
step's items, or the slice of the longest item its LSSP group gives it, `encoders.omni_encoder_bytes`).
"""

from __future__ import annotations

from omni_core.common.catalog import GpuSpec
from omni_core.estimator.encoders import encoder_sums, omni_encoder_bytes
from omni_core.estimator.pipeline import Sums
from omni_core.estimator.stage import rank_params
from omni_core.estimator.terms import PlanTerms


def param_state_bytes(terms: PlanTerms, shards: int) -> float:
    """One parameter's model states on a rank whose shard group has `shards` ranks, by the plan's sharding stage:
    FSDP divides all of them; ZeRO-2 the optimizer states and the gradients (where the runtime reduces them
    during the backward, else they are whole at its end), ZeRO-1 the optimizer states; replicate none. The fp32
    master copy of 2-byte weights is sharded with the states where the runtime keeps whole compute-precision
    weights beside it (`Efficiency.zero_master_sharded`), else it is the whole parameter (omni's runtime)."""
    stage, eff, n = terms.plan.sharding, terms.eff, max(shards, 1)
    if stage == "fsdp":
        return terms.state_bytes / n
    if stage == "replicate":
        return terms.state_bytes
    master_sharded = terms.master_bytes if eff.zero_master_sharded else 0.0
    whole = terms.weight_bytes + terms.master_bytes - master_sharded
    grads_sharded = stage == "zero2" and eff.zero_reduce_in_backward
    return whole + eff.grad_bytes / (n if grads_sharded else 1) + (terms.optimizer_state_bytes + master_sharded) / n


def model_state_bytes(terms: PlanTerms, st: Sums) -> float:
    """A stage's weights, gradients and optimizer states on one rank."""
    dense_params, expert_params = rank_params(terms, st)
    return dense_params * param_state_bytes(terms, terms.shards) + expert_params * param_state_bytes(
        terms, terms.expert_shards
    )


def gathered_bytes(terms: PlanTerms, st: Sums) -> float:
    """FSDP's gathered full weights when it shards: twice the stage's largest layer's (ZeRO keeps them whole)."""
    return 2 * st.max_params / terms.plan.tp * terms.weight_bytes if terms.fsdp and terms.shards > 1 else 0.0


def in_flight(terms: PlanTerms, stage: int) -> float:
    """Micro-batches whose activations pipeline rank `stage` holds at its peak, in whole micro-batches of all its
    layers, under the runtime's schedule (torch.distributed.pipelining's, which are Megatron-LM's): GPipe all of
    the step's; 1F1B its warm-up forwards and the steady state's one, one per stage from this one to the last;
    interleaved 1F1B its warm-up chunks and one, each chunk 1/v of its layers: (v - 1) rounds of micro-batches
    plus two per stage to the last (`_get_warmup_ops`), at most all of the step's."""
    plan, m = terms.plan, terms.micro_batches
    if plan.pp_schedule == "GPipe":
        return m
    if plan.pp_schedule == "Interleaved1F1B":
        v = plan.virtual_stages
        per_round = m // max(1, m // plan.pp)
        return min((v - 1) * per_round + 2 * (plan.pp - 1 - stage) + 1, m * v) / v
    return min(m, plan.pp - stage)


def activation_bytes(terms: PlanTerms, st: Sums, stage: int) -> float:
    """The activations stage `stage` keeps for the micro-batches in flight (`in_flight`); with checkpointing
    only the layers' outputs (selective: with what it keeps besides, `terms.Options.selective`), plus the
    largest layer's activations while it is recomputed."""
    mb, options = terms.options.micro_batch, terms.options
    held = in_flight(terms, stage)
    if not options.checkpoint:
        return st.act_bytes * mb / terms.split * held
    kept = {"": st.out_bytes, "layer": (st.out_bytes + st.act_bytes) / 2, "op": st.out_bytes + st.sac_bytes}
    return (kept[options.selective] * held + st.max_act) * mb / terms.split


def coupled_encoder_bytes(terms: PlanTerms) -> float:
    """The `coupled` encoders' states and activations on a stage-0 rank: states sharded like stage 0's, the
    micro-batch's samples' activations."""
    enc, mb = encoder_sums(terms.workload), terms.options.micro_batch
    acts = (enc.out_bytes + enc.max_act) if terms.options.checkpoint else enc.act_bytes
    return enc.params * param_state_bytes(terms, terms.shards) + acts * mb / terms.encoder_split * (
        1 + terms.eff.workspace_frac
    )


def peak_memory(terms: PlanTerms, groups: tuple[tuple[Sums, int, int], ...]) -> tuple[float, dict[str, float]]:
    """(peak bytes over the stages, what makes it up: the stage, its model states and activations in GB)."""
    omni = terms.plan.encoders.layout == "omni"
    encoders = 0.0
    if terms.workload.encoder:
        encoders = omni_encoder_bytes(terms) if omni else coupled_encoder_bytes(terms)
    peak, worst = 0.0, {}
    for st, stage, _ in groups:
        states = model_state_bytes(terms, st)
        acts = activation_bytes(terms, st, stage)
        mem = states + gathered_bytes(terms, st) + acts * (1 + terms.eff.workspace_frac)
        if omni or stage == 0:
            mem += encoders
        if mem > peak:
            peak = mem
            worst = {"stage": stage, "states_gb": states / 1e9, "activations_gb": acts / 1e9}
    return peak, worst


def out_of_memory(peak: float, worst: dict[str, float], gpu: GpuSpec) -> str:
    """The reason a plan needing `peak` bytes (`peak_memory`) does not fit `gpu`."""
    return (
        f"out of memory: {peak / 1e9:.1f} GB needed on stage {worst['stage']} "
        f"({worst['states_gb']:.1f} GB model states, {worst['activations_gb']:.1f} GB activations) > "
        f"{gpu.usable_bytes / 1e9:.1f} GB usable on {gpu.name}"
    )
