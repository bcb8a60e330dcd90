"""The pipeline: layers partitioned into stages, and a step's time from the stages' micro-batch times.

The runtime splits the LLM's layers into contiguous stages (`partition`, as `parallel.pipeline.balance_layers`
does); each stage's layer totals (`Sums`) are memoised per (workload, pp), so a plan costs O(stages). A
schedule the runtime would refuse for the step's micro-batches is refused here too (`schedule_refusal`).
Given the stages' times t_s, a step's pipeline takes, for m micro-batches per step over pp stages of v
virtual stages each:

    1F1B / GPipe   (m - 1) * max_s(t_s) + sum_s(t_s)      warm-up + steady state + cool-down
    interleaved    (m + (pp - 1) / v) * max_s(t_s)
    no pipeline    m * t_0

and its bubble is what exceeds m * max_s(t_s).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from omni_core.common.plan import ParallelPlan, PlanError
from omni_core.estimator.workloads import Layer, Workload

_SUMMED = (
    "flops",
    "expert_flops",
    "attn_flops",
    "attn_scores",
    "mm_bytes",
    "mm_weight_bytes",
    "mem_bytes",
    "ops",
    "sample_ops",
    "expert_ops",
    "attn_calls",
    "tp_bytes",
    "tp_colls",
    "tp_modules",
    "a2a_bytes",
    "act_bytes",
    "sac_bytes",
    "sac_flops",
    "params",
    "expert_params",
    "tensors",
    "expert_tensors",
    "units",
)


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
    sac_bytes: float
    sac_flops: float
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
        return cls(
            **{name: sum(getattr(layer, name) for layer in layers) for name in _SUMMED},
            causal_attn_flops=sum(layer.attn_flops for layer in layers if layer.causal),
            attn_layers=sum(1 for layer in layers if layer.attn_flops or layer.attn_calls),
            moe_layers=sum(1 for layer in layers if layer.a2a_bytes),
            routed_experts=experts,
            block_io=sum(layer.out_bytes for layer in layers if layer.attn_flops or layer.attn_calls),
            out_bytes=sum(layer.out_bytes for layer in layers),
            max_act=max((layer.act_bytes for layer in layers), default=0.0),
            max_params=max((layer.params for layer in layers), default=0.0),
            boundary=layers[-1].out_bytes if layers else 0.0,
        )


def partition(workload: Workload, pp: int) -> tuple[int, ...]:
    """Stage boundaries over the LLM layers (embedding, blocks, head), as the runtime splits them: contiguous
    blocks, the embedding with the first and the head with the last, cut where the cost prefix crosses k/pp
    of the total (nearest side), at least one block per stage. Memoised per workload."""
    key = ("cuts", pp)
    cuts = workload.cache.get(key)
    if cuts is None:
        layers = len(workload.llm)
        prefix = workload.cost_prefix
        total = prefix[-1]
        bounds = [0]
        for k in range(1, pp):
            target = total * k / pp
            lowest, highest = max(bounds[-1] + 1, 2), layers - 1 - (pp - k)
            cut = lowest
            while cut < highest and prefix[cut] < target:
                cut += 1
            if cut > lowest and abs(prefix[cut - 1] - target) <= abs(prefix[cut] - target):
                cut -= 1
            bounds.append(cut)
        bounds.append(layers)
        cuts = workload.cache[key] = tuple(bounds)
    return cuts


def stage_sums(workload: Workload, pp: int) -> tuple[Sums, ...]:
    """Each stage's layer totals, in pipeline order. Memoised per workload."""
    key = ("stages", pp)
    stages = workload.cache.get(key)
    if stages is None:
        cuts = partition(workload, pp)
        experts = workload.shape.num_experts
        stages = workload.cache[key] = tuple(
            Sums.of(workload.llm[start:end], experts) for start, end in itertools.pairwise(cuts)
        )
    return stages


def stage_groups(workload: Workload, pp: int) -> tuple[tuple[Sums, int, int], ...]:
    """The pipeline's distinct stages as (sums, index of the first such stage, how many), stage 0 apart:
    equal stages cost the same, and the first of them keeps the most micro-batches in flight."""
    key = ("groups", pp)
    groups = workload.cache.get(key)
    if groups is None:
        found: dict[tuple[Sums, bool], list[int]] = {}
        for index, sums in enumerate(stage_sums(workload, pp)):
            found.setdefault((sums, index == 0), []).append(index)
        groups = workload.cache[key] = tuple((sums, where[0], len(where)) for (sums, _), where in found.items())
    return groups


def stage_group_positions(workload: Workload, pp: int) -> tuple[int, ...]:
    """For each pipeline stage in order, the position of its group in `stage_groups`."""
    positions: dict[tuple[Sums, bool], int] = {}
    return tuple(
        positions.setdefault((sums, index == 0), len(positions)) for index, sums in enumerate(stage_sums(workload, pp))
    )


def schedule_refusal(plan: ParallelPlan, m: int) -> str:
    """Why the runtime would refuse to run `m` micro-batches per step through `plan`'s pipeline schedule
    (`ParallelPlan.check_microbatches`, torch.distributed.pipelining's rules), or "" when it runs them."""
    try:
        plan.check_microbatches(m)
    except PlanError as err:
        return str(err)
    return ""


def pipeline_seconds(
    plan: ParallelPlan, m: int, stage_times: Sequence[float], counts: Sequence[int]
) -> tuple[float, float]:
    """(pipeline, bubble) seconds of a step's `m` micro-batches through stages taking `stage_times` each
    (one per distinct stage, `counts` stages alike; the module's formula)."""
    slowest = max(stage_times)
    if plan.pp_schedule == "Interleaved1F1B":
        pipeline = (m + (plan.pp - 1) / plan.virtual_stages) * slowest
    else:
        pipeline = (m - 1) * slowest + sum(time * count for time, count in zip(stage_times, counts))
    bubble = pipeline - m * slowest if plan.pp > 1 else 0.0
    return pipeline, bubble


def schedule_order(schedule: str, pp: int, stage: int, m: int) -> list[tuple[str, int]]:
    """The (pass, micro-batch) order one stage runs: GPipe's forwards then backwards; 1F1B's warm-up
    forwards (one fewer per later stage), then one forward and one backward in turn, then the rest."""
    if schedule == "GPipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    warm = min(pp - 1 - stage, m)
    order = [("F", j) for j in range(warm)]
    for j in range(m - warm):
        order += [("F", warm + j), ("B", j)]
    return order + [("B", j) for j in range(m - warm, m)]


def time_shared_pipeline(
    schedule: str, m: int, work: Sequence[tuple[float, float]], forward_share: float, ranks_per_stage: float, cores: int
) -> float:
    """Seconds of `m` micro-batches through a GPipe or 1F1B pipeline whose ranks time-share `cores`, simulated:
    a micro-batch's forward and backward on stage s take `work[s]` = (seconds on a core, seconds waiting on a
    collective, which need none), `forward_share` of each in forward; every stage runs its schedule in order,
    a pass once its input is there; the node's computing ranks (`ranks_per_stage` per computing stage: its
    replicas and tensor ranks) share the cores equally."""
    pp = len(work)
    orders = [schedule_order(schedule, pp, s, m) for s in range(pp)]
    done: set[tuple[str, int, int]] = set()
    heads, busy, waits = [0] * pp, [0.0] * pp, [0.0] * pp

    def load(s: int) -> None:
        if heads[s] < len(orders[s]):
            share = forward_share if orders[s][heads[s]][0] == "F" else 1.0 - forward_share
            busy[s], waits[s] = work[s][0] * share, work[s][1] * share

    def ready(s: int) -> bool:
        if heads[s] >= len(orders[s]):
            return False
        kind, j = orders[s][heads[s]]
        if kind == "F":
            return s == 0 or ("F", s - 1, j) in done
        return s == pp - 1 or ("B", s + 1, j) in done

    for s in range(pp):
        load(s)
    clock = 0.0
    while len(done) < 2 * m * pp:
        running = [s for s in range(pp) if ready(s)]
        computing = [s for s in running if busy[s] > 0]
        rate = min(1.0, cores / (ranks_per_stage * len(computing))) if computing else 1.0
        step = min(busy[s] / rate if busy[s] > 0 else waits[s] for s in running)
        clock += step
        for s in running:
            if busy[s] > 0:
                busy[s] = busy[s] - step * rate if busy[s] - step * rate > 1e-12 else 0.0
            else:
                waits[s] = waits[s] - step if waits[s] - step > 1e-12 else 0.0
            if busy[s] == 0 and waits[s] == 0:
                kind, j = orders[s][heads[s]]
                done.add((kind, s, j))
                heads[s] += 1
                load(s)
    return clock
