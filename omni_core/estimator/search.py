"""Cells and the plan search inside each.

A Cell fixes (job, GPU type, GPU count, nodes x GPUs per node, pipeline stages); inside it the search tries
DP x TP per stage (FSDP, or HSDP when DP crosses nodes, or replicated), the sharding stage of the shard group
(FSDP, ZeRO-2, ZeRO-1: `SEARCHED_SHARDING`, where the runtime builds it), CP for long sequences, EP for MoE,
the micro-batch size (the largest that fits without pipelining; with it, from 1 up until memory runs out), activation
checkpointing (wherever memory refused a micro-batch without it, unless the job fixes it) and, for MLLMs, the
encoders' half of the plan in the searched layout (`encoder_variants`: `omni` and `disaggregated` their LSSP
group with its long-item threshold and replicated or FSDP weights, the joint schedule beside the phased one
where the runtime runs it and it can gain (`encoder_schedules`, with pipeline stages or disaggregated
encoders), `disaggregated` also how many ranks the encoders get: DistTrain's splits, `orchestration`); it drops
plans that do not fit memory and plans the runtime would refuse (the plan object's `check_model`, the pipeline
schedule's micro-batch rules: `pipeline.schedule_refusal`), and keeps the fastest plus runners-up. `CellTable`
is the stage's typed result; its plan names carry the encoders' half (`dp1-tp2+omni.v-sp2-t256`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from pydantic import Field

from omni_core.common.catalog import GpuCatalog, GpuSpec
from omni_core.common.plan import (
    CpKind,
    EncoderLayout,
    EncoderPlan,
    EncoderSchedule,
    EncoderSpec,
    ParallelPlan,
    PipelineSchedule,
    PlanError,
    Sharding,
)
from omni_core.common.results import Result
from omni_core.estimator.calibration import calibrated, calibration_digest
from omni_core.estimator.cost import Efficiency, Estimate, Options, estimate_step
from omni_core.estimator.encoders import encoder_parts, long_tokens_threshold
from omni_core.estimator.orchestration import (
    disaggregated_splits,
    megatron_splits_layers,
    node_aligned,
    pipeline_depths,
    powers_of_two,
)
from omni_core.estimator.workloads import Workload

RUNNERS_UP = 3
CP_KINDS: tuple[CpKind, ...] = ("ulysses", "ring")
# the shard group's stages the search tries; replicated data parallelism is searched as dp_replicate
SEARCHED_SHARDING: tuple[Sharding, ...] = ("fsdp", "zero2", "zero1")
LONG_SEQ = 8192  # context parallelism is searched only from this many tokens per sample
NO_PLAN = "no plan divides the model on these GPUs"


def candidate_plans(
    workload: Workload, num_gpus: int, gpus_per_node: int, pp: int, *, zero: bool = True
) -> Iterator[ParallelPlan]:
    """Every plan of `pp` stages on `num_gpus` GPUs the model can be split by (TP inside a node), each sharding
    stage of `SEARCHED_SHARDING` where the shard group has several ranks (`zero`: the ZeRO stages too; the
    runtime builds them without EP and with coupled encoders only)."""
    if num_gpus % pp:
        return
    per_stage, shape = num_gpus // pp, workload.shape
    schedules: list[tuple[PipelineSchedule, int]] = [("1F1B", 1)]
    if pp > 1 and shape.n_layers >= 2 * pp:
        schedules.append(("Interleaved1F1B", 2))
    for tp in powers_of_two(min(per_stage, gpus_per_node)):
        for cp in powers_of_two(per_stage // tp) if (shape.seq_len or 0) >= LONG_SEQ else [1]:
            dp = per_stage // (tp * cp)
            if dp * tp * cp != per_stage:
                continue
            # FSDP over all of DP, or HSDP: shard inside a node, replicate across nodes; replicated DDP
            splits = {(1, dp), (dp, 1)}
            inside = max(1, gpus_per_node // (tp * cp))
            if 1 < inside < dp and dp % inside == 0:
                splits.add((dp // inside, inside))
            for replicate, shard in sorted(splits):
                eps = [e for e in powers_of_two(shard * cp) if shape.num_experts % e == 0] if shape.num_experts else [1]
                for ep, kind, (schedule, virtual) in itertools.product(eps, CP_KINDS[: 1 + (cp > 1)], schedules):
                    stages = SEARCHED_SHARDING if zero and ep == 1 and shard * cp > 1 else ("fsdp",)
                    for sharding in stages:
                        try:
                            plan = ParallelPlan(
                                replicate, shard, tp, pp, cp, ep, kind, schedule, virtual, sharding=sharding
                            )
                            plan.check_model(shape)
                        except PlanError:
                            continue
                        yield plan


def lssp_groups(workload: Workload, ranks: int, gpus_per_node: int) -> list[int]:
    """LSSP group sizes worth trying over `ranks` encoder ranks: 1, and powers of two inside a node that divide
    the long-item encoder's heads, up to the one that cuts the longest item below a rank's balanced share of
    the encoder work."""
    needed = workload.encoder_max_item * ranks / workload.global_batch
    return [
        g
        for g in powers_of_two(min(gpus_per_node, ranks))
        if g == 1 or (g / 2 < needed and workload.items.heads % g == 0)
    ]


def encoder_plans(
    workload: Workload,
    layout: EncoderLayout,
    ranks: int,
    encoder_ranks: int,
    gpus_per_node: int,
    schedules: tuple[EncoderSchedule, ...] = ("phased",),
) -> list[EncoderPlan]:
    """The encoder halves of `layout` on `encoder_ranks` ranks (`ranks` of them the encoders' own): each LSSP
    group of `lssp_groups` for the long-item encoder, with the threshold that splits what balancing cannot
    even out (`encoders.long_tokens_threshold`), every encoder's weights replicated or FSDP-sharded, under
    each of `schedules`."""
    threshold = long_tokens_threshold(workload, encoder_ranks)
    plans = []
    for group in lssp_groups(workload, encoder_ranks, gpus_per_node):
        for fsdp in (False, True):
            specs = {key: EncoderSpec(fsdp=fsdp) for key in encoder_parts(workload)}
            if group > 1:
                specs[workload.items.encoder] = EncoderSpec(lssp=group, long_tokens=threshold, fsdp=fsdp)
            plans += [EncoderPlan(layout, ranks=ranks, schedule=schedule, **specs) for schedule in schedules]
    return plans


def encoder_variants(
    workload: Workload,
    layout: EncoderLayout,
    num_gpus: int,
    gpus_per_node: int,
    schedules: tuple[EncoderSchedule, ...] = ("phased",),
    pp: int = 1,
) -> list[tuple[int, list[EncoderPlan]]]:
    """(encoder-only ranks, the encoder halves to try with LLM plans of `pp` stages on the rest) for `layout`
    under each of `schedules`; a workload without encoder items (text only: the encoders run a dummy input
    wherever they are) has the default half only. `disaggregated`: DistTrain's splits (`orchestration`), each
    LSSP group inside a node once the Cell spans several."""
    if not workload.items.count or layout == "coupled":
        return [(0, [EncoderPlan()])]
    if layout == "omni":
        return [(0, encoder_plans(workload, "omni", 0, num_gpus, gpus_per_node, schedules))]
    model_parallel = num_gpus if (workload.shape.seq_len or 0) >= LONG_SEQ else gpus_per_node  # TP x CP
    variants = []
    for k in disaggregated_splits(workload, num_gpus, pp, model_parallel):
        plans = encoder_plans(workload, "disaggregated", k, k, gpus_per_node, schedules)
        variants.append((k, [e for e in plans if num_gpus <= gpus_per_node or node_aligned(e, num_gpus - k)]))
    return variants


def encoder_schedules(gpu: GpuSpec) -> tuple[EncoderSchedule, ...]:
    """The encoder schedules the runtime runs on `gpu`: the joint one on the catalogue's CPU device only
    (`parallel/joint.py`: on CUDA it needs a low-priority stream, not built), so GPU Cells are never handed a
    plan the runtime refuses."""
    return ("phased", "joint") if gpu.name == "cpu" else ("phased",)


def search_plans(
    workload: Workload,
    gpu: GpuSpec,
    plans: Iterable[ParallelPlan],
    encoders: Sequence[EncoderPlan] = (EncoderPlan(),),
    *,
    gpus_per_node: int,
    eff: Efficiency,
    max_micro_batch: int = 8,
) -> tuple[list[Estimate], str]:
    """Fitting estimates, fastest first, one per LLM plan of `plans` (with the fastest of `encoders` as its
    encoder half), and (when none fits) the reason of the plan closest to fitting."""
    fits: list[Estimate] = []
    closest: Estimate | None = None
    for plan in plans:
        local = workload.global_batch // plan.dp if workload.global_batch % plan.dp == 0 else 0
        if not local:
            closest = closest or Estimate(
                plan,
                Options(),
                peak_mem_bytes=math.inf,
                reason=(f"global_batch={workload.global_batch} is not divisible by dp={plan.dp}"),
            )
            continue
        sizes = [mb for mb in powers_of_two(min(local, max_micro_batch)) if local % mb == 0]
        options, refused = _micro_batch_options(
            workload, gpu, plan, encoders, sizes, gpus_per_node=gpus_per_node, eff=eff
        )
        for est in refused:
            if closest is None or est.peak_mem_bytes < closest.peak_mem_bytes:
                closest = est
        if options:
            fits.append(min(options, key=lambda e: e.step_time_s))  # one entry per plan
    fits.sort(key=lambda e: e.step_time_s)
    return fits, ("" if fits else (closest.reason if closest else NO_PLAN))


def _micro_batch_options(
    workload: Workload,
    gpu: GpuSpec,
    plan: ParallelPlan,
    encoders: Sequence[EncoderPlan],
    sizes: list[int],
    *,
    gpus_per_node: int,
    eff: Efficiency,
) -> tuple[list[Estimate], list[Estimate]]:
    """The fitting estimates of an LLM plan over micro-batch `sizes` and checkpointing, each with the fastest of
    `encoders` as its encoder half; and the refused ones, in the order they were tried.

    Memory grows with the micro-batch. With pipeline stages, smaller micro-batches shrink the bubble: try them
    from 1 up until memory runs out or the step gets slower. Without, the largest that fits is fastest (per-op
    costs amortise): try from the top down. Checkpointing is searched like the rest (it costs a forward but can
    fit a larger micro-batch) unless the job fixes it (`Workload.recompute`): it is tried when memory refused a
    micro-batch without it (otherwise each of its options only adds time)."""
    descending = plan.pp == 1
    variants = [replace(plan, encoders=e) for e in encoders]
    options: list[Estimate] = []
    refused: list[Estimate] = []
    memory_bound = False
    for checkpoint in (False, True) if workload.recompute is None else (workload.recompute,):
        if checkpoint and workload.recompute is None and not memory_bound:
            break
        tried: list[Estimate] = []
        for mb in sizes[::-1] if descending else sizes:
            est = min(
                (
                    estimate_step(workload, gpu, variant, Options(mb, checkpoint), gpus_per_node=gpus_per_node, eff=eff)
                    for variant in variants
                ),
                key=lambda e: (not e.fits, e.step_time_s),
            )
            if not est.fits:
                memory_bound |= est.reason.startswith("out of memory")
                refused.append(est)
                if descending:
                    continue
                break
            if tried and est.step_time_s > tried[-1].step_time_s:
                break  # past the best micro-batch: bubbles shrink no more than per-micro-batch costs grow
            tried.append(est)
            if descending:
                break
        options += tried
    return options, refused


@dataclass
class CellResult:
    gpu_type: str
    num_gpus: int
    nodes: int
    gpus_per_node: int
    pp: int
    best: Estimate | None
    runners_up: list[Estimate] = field(default_factory=list)
    reason: str = ""

    @property
    def plan(self) -> ParallelPlan | None:
        return self.best.plan if self.best else None

    @property
    def samples_per_s(self) -> float:
        return self.best.samples_per_s if self.best else 0.0


def cell_shape(num_gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs used per node): whole nodes once a Cell needs more than one."""
    return math.ceil(num_gpus / gpus_per_node), min(num_gpus, gpus_per_node)


def search_cell(
    workload: Workload,
    gpu: GpuSpec,
    num_gpus: int,
    gpus_per_node: int,
    pp: int,
    *,
    eff: Efficiency,
    layout: EncoderLayout = "omni",
) -> CellResult:
    """The Cell's best plans whose encoders are laid out as `layout` (`encoder_variants`)."""
    nodes, per_node = cell_shape(num_gpus, gpus_per_node)
    fits: list[Estimate] = []
    reasons = []
    # one stage has no bubbles for the joint schedule to fill (`encoders.omni_encoder_seconds`): it could only
    # add its per-micro-batch rounds; DistTrain's (disaggregated) overlaps the two sides at any depth
    schedules = encoder_schedules(gpu) if pp > 1 or layout == "disaggregated" else ("phased",)
    for ranks, encoders in encoder_variants(workload, layout, num_gpus, per_node, schedules, pp):
        zero = all(e.layout == "coupled" for e in encoders)  # ZeRO's runtime reduces coupled encoders only
        plans: Iterable[ParallelPlan] = candidate_plans(workload, num_gpus - ranks, per_node, pp, zero=zero)
        if ranks:  # DistTrain's LLM is Megatron-LM's (`orchestration`)
            plans = (p for p in plans if megatron_splits_layers(p, workload.shape.n_layers))
        found, reason = search_plans(workload, gpu, plans, encoders, gpus_per_node=per_node, eff=eff)
        fits += found
        reasons.append(reason)
    fits.sort(key=lambda e: e.step_time_s)
    reason = "" if fits else next((r for r in reasons if r != NO_PLAN), NO_PLAN)
    return CellResult(
        gpu.name, num_gpus, nodes, per_node, pp, fits[0] if fits else None, fits[1 : 1 + RUNNERS_UP], reason
    )


def best_for_gpus(
    workload: Workload,
    gpu: GpuSpec,
    num_gpus: int,
    gpus_per_node: int,
    *,
    eff: Efficiency | None = None,
    layout: EncoderLayout = "omni",
) -> CellResult | None:
    """The fastest Cell over pipeline depths for this GPU count; None if none fits."""
    if eff is None:
        gpu, eff = calibrated(gpu)
    best, best_time = None, math.inf
    for pp in pipeline_depths(workload, num_gpus, layout):
        cell = search_cell(workload, gpu, num_gpus, gpus_per_node, pp, eff=eff, layout=layout)
        if cell.best and (best is None or cell.best.step_time_s < best_time):
            best, best_time = cell, cell.best.step_time_s
    return best


# --- the typed result --------------------------------------------------------------------------------------


class PlanRow(Result):
    plan: str  # ParallelPlan.name, the encoders' half included; ParallelPlan.parse(plan) is what the runtime executes
    micro_batch: int
    checkpoint: bool
    step_time_s: float
    samples_per_s: float
    peak_mem_gb: float


class CellRow(Result):
    job: str
    gpu_type: str
    num_gpus: int
    nodes: int
    gpus_per_node: int
    pp: int
    layout: str  # the encoder layout the Cell's search laid plans out in (a plan without encoders names none)
    plan: str
    micro_batch: int
    checkpoint: bool
    step_time_s: float
    samples_per_s: float
    peak_mem_gb: float
    breakdown: dict[str, float]
    runners_up: list[PlanRow]

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan.parse(self.plan)

    def cell_result(self) -> CellResult:
        """The search's result this row was made from (`cell_row`), without its runners-up."""
        options = Options(self.micro_batch, self.checkpoint)
        best = Estimate(
            self.parallel_plan(),
            options,
            self.step_time_s,
            self.samples_per_s,
            self.peak_mem_gb * 1e9,
            breakdown=dict(self.breakdown),
        )
        return CellResult(self.gpu_type, self.num_gpus, self.nodes, self.gpus_per_node, self.pp, best)


class Unfit(Result):
    job: str
    reason: str


class CellTable(Result):
    """Per job and Cell the best plan, its predicted step time, throughput and memory; jobs that fit no Cell
    are listed in `unfit` with the reason."""

    cells: list[CellRow]
    unfit: list[Unfit]
    seconds: float = 0.0  # time the search took
    # per GPU type of the cluster, the digest of the stored calibration the estimates used ("": the catalogue's)
    calibrations: dict[str, str] = Field(default_factory=dict)

    def best(self, job: str) -> CellRow | None:
        rows = [c for c in self.cells if c.job == job]
        return max(rows, key=lambda c: c.samples_per_s) if rows else None

    def best_cells(self, job: str) -> dict[tuple[str, int], CellRow]:
        """Per (GPU type, GPU count), the job's fastest row over its pipeline depths."""
        best: dict[tuple[str, int], CellRow] = {}
        for row in self.cells:
            key = (row.gpu_type, row.num_gpus)
            if row.job == job and (key not in best or row.samples_per_s > best[key].samples_per_s):
                best[key] = row
        return best

    def ranked(self) -> list[CellRow]:
        return sorted(self.cells, key=lambda c: (c.job, -c.samples_per_s))


def _plan_row(est: Estimate) -> PlanRow:
    return PlanRow(
        plan=est.plan.name,
        micro_batch=est.options.micro_batch,
        checkpoint=est.options.checkpoint,
        step_time_s=est.step_time_s,
        samples_per_s=est.samples_per_s,
        peak_mem_gb=est.peak_mem_bytes / 1e9,
    )


def cell_row(job: str, cell: CellResult, layout: EncoderLayout = "omni") -> CellRow:
    best = cell.best
    assert best is not None
    return CellRow(
        job=job,
        gpu_type=cell.gpu_type,
        num_gpus=cell.num_gpus,
        nodes=cell.nodes,
        gpus_per_node=cell.gpus_per_node,
        pp=cell.pp,
        layout=layout,
        **_plan_row(best).model_dump(),
        breakdown={k: float(v) for k, v in best.breakdown.items()},
        runners_up=[_plan_row(e) for e in cell.runners_up],
    )


def job_cells(
    job: str,
    workload: Workload,
    catalog: GpuCatalog,
    gpus: dict[str, int],
    gpus_per_node: dict[str, int],
    layout: EncoderLayout = "omni",
) -> tuple[list[CellRow], Unfit | None]:
    """One job's Cells on the cluster: GPU counts 1, 2, 4, ... up to what each type has, each pipeline
    depth; the job is `Unfit` (with the reason of its largest Cell) when none of them holds it."""
    rows: list[CellRow] = []
    last_reason = "the cluster has no GPU"
    for gpu_type, count in gpus.items():
        gpu, eff = calibrated(catalog[gpu_type])
        per_node = gpus_per_node.get(gpu_type, gpu.gpus_per_node)
        for n in powers_of_two(count):
            for pp in pipeline_depths(workload, n, layout):
                cell = search_cell(workload, gpu, n, per_node, pp, eff=eff, layout=layout)
                if cell.best:
                    rows.append(cell_row(job, cell, layout))
                else:
                    last_reason = f"{gpu.name} x{n} pp{pp}: {cell.reason}"
    unfit = None if rows else Unfit(job=job, reason=f"fits no Cell of the cluster; e.g. {last_reason}")
    return rows, unfit


def _job_cells(args: tuple) -> tuple[list[CellRow], Unfit | None]:
    return job_cells(*args)


def build_cell_table(
    jobs: dict[str, Workload],
    catalog: GpuCatalog,
    gpus: dict[str, int],
    *,
    gpus_per_node: dict[str, int] | None = None,
    layout: EncoderLayout = "omni",
    workers: int = 1,
) -> CellTable:
    """Every Cell of every job on the cluster `gpus` (GPU type -> GPUs of that type), jobs spread over
    `workers` forked processes. A job no Cell can hold is reported in `unfit`, not dropped."""
    import time
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    start = time.perf_counter()
    tasks = [(job, w, catalog, gpus, gpus_per_node or {}, layout) for job, w in jobs.items()]
    if workers > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
            results = list(pool.map(_job_cells, tasks, chunksize=max(1, len(tasks) // (4 * workers))))
    else:
        results = [_job_cells(t) for t in tasks]
    rows = [row for job_rows, _ in results for row in job_rows]
    unfit = [u for _, u in results if u is not None]
    return CellTable(
        cells=rows,
        unfit=unfit,
        seconds=time.perf_counter() - start,
        calibrations={gpu_type: calibration_digest(catalog[gpu_type].name) for gpu_type in gpus},
    )
