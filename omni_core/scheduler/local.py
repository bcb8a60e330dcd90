"""Real mode: the scheduler's policies place the recipe's jobs on CPU slots, and the jobs train.

The cluster is this machine as one node of `cluster.slots` CPU slots, one rank each, or a Slurm cluster's nodes
of CPU slots (`real_cluster`), so the simulator's `Cluster`, policies and `ThroughputTable` decide, with the
estimator as the throughput oracle (`CellOracle` on the catalogue's `cpu` entry, for the jobs' model flavors on
the recipe's data). A placed job runs the estimator's best plan for its Cell (its slots, over as few nodes as
hold them), with that plan's micro-batch and activation checkpointing: the plan the estimator ranked is the
plan that runs. On Slurm each launch is pinned to the nodes the job was placed on (`--nodelist`), so Slurm
runs what the scheduler decided, not a placement of its own.

A job trains in segments of `schedule.segment_steps` steps. A segment is one launch of the job's own recipe,
derived from the base recipe by overrides (`job_overrides`): `train.stop_at_step` is the segment's last step
(`train.steps` stays the job's, so the LR schedule spans the whole job),
`parallel.*` the plan, `train.grad_accum` whatever keeps the job's global batch on that plan. A segment ends
at a step boundary with a checkpoint, so that is where the scheduler may resize the job: the next segment
runs under the new plan and resumes from that checkpoint (weights and optimizer reshard through DCP; the data
order restarts). All segments of a job share one checkpoint directory (`job_checkpoint_dir`): the default
one is keyed by the training hash, which covers grad_accum and micro_batch, both of which change with the
plan.

The policy decides when a job arrives (`arrival_s` seconds after the start) and whenever a segment ends. A
job in the middle of a segment keeps its slots; what the policy wants for it takes effect at its next
boundary, where the policy decides again. Every launch restarts the job anyway, so a resize costs nothing
over staying: the policies see restart_s = 0, and no plan search or profiling cost (the estimator answers).
"""

from __future__ import annotations

import contextvars
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omni_core.common.results import Result, TrainResult
from omni_core.recipe.model_sections import ParallelConfig
from omni_core.recipe.schema import Recipe
from omni_core.scheduler.cluster import Cluster, GroupSpec, Placement
from omni_core.scheduler.jobs import Job, ThroughputTable
from omni_core.scheduler.policies import make_policy
from omni_core.scheduler.policies.base import View
from omni_core.scheduler.simulator import JobRecord, Segment

if TYPE_CHECKING:
    from omni_core.data.profile_result import DatasetProfile
    from omni_core.estimator.cost import Estimate
    from omni_core.estimator.oracle import CellOracle
    from omni_core.estimator.search import CellTable

SLOT_TYPE = "cpu"  # the GPU catalogue's entry for this machine's CPU


def default_slots() -> int:
    """This machine's CPUs rounded down to a power of two (jobs take 1, 2, 4, ... slots)."""
    return 1 << ((os.cpu_count() or 1).bit_length() - 1)


def real_cluster(recipe: Recipe) -> Cluster:
    """The slots jobs are placed on: `cluster.slots` (one node: this machine, or a node Slurm picks), or one node
    group of `cpu` slots: one node, or, with launch.target slurm, several whose Slurm names (`hosts`) pin each
    launch where the job was placed."""
    cfg = recipe.cluster
    if not cfg.node_groups:
        return Cluster({SLOT_TYPE: GroupSpec(SLOT_TYPE, 1, cfg.slots or default_slots(), "loopback")})
    cluster = Cluster.from_config(cfg)
    if list(cluster.groups) != [SLOT_TYPE]:
        shape = ", ".join(f"{g.nodes}x{g.gpus_per_node} {t}" for t, g in cluster.groups.items())
        raise ValueError(
            f"cluster {cfg.name!r} is {shape}: `omni schedule` places jobs on {SLOT_TYPE} slots "
            f"(cluster.slots, or one node group with gpu_type {SLOT_TYPE}); `omni simulate` studies "
            "other clusters"
        )
    group = cluster.groups[SLOT_TYPE]
    if group.nodes > 1 and (recipe.launch.target != "slurm" or not cfg.node_groups[0].hosts):
        raise ValueError(
            f"cluster {cfg.name!r} has {group.nodes} nodes: `omni schedule` places jobs past one node "
            "only on Slurm (launch.target: slurm) with the nodes' names in cluster.node_groups.0.hosts"
        )
    return cluster


def check_recipe(recipe: Recipe) -> None:
    """Refuse, in one message, what real mode cannot run: a cluster it cannot place on, jobs that are not
    model flavors, job names that cannot name runs and directories or are taken twice."""
    from omni_core.models.flavors import FLAVORS

    problems = [] if recipe.jobs else ["the recipe has no jobs"]
    try:
        real_cluster(recipe)
    except ValueError as e:
        problems.append(str(e))
    names = [job.name for job in recipe.jobs]
    for i, job in enumerate(recipe.jobs):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", job.name):
            problems.append(f"jobs[{i}].name {job.name!r}: letters, digits, _ . - only (it names runs and directories)")
        elif names.index(job.name) != i:
            problems.append(f"jobs[{i}].name {job.name!r} is taken by jobs[{names.index(job.name)}]")
        if job.model not in FLAVORS:
            problems.append(
                f"jobs[{i}].model {job.model!r} is not a model flavor ({', '.join(sorted(FLAVORS))}); "
                "trace models are for `omni simulate`"
            )
    if problems:
        raise ValueError("; ".join(problems))


def recipe_oracle(
    recipe: Recipe, cluster: Cluster, profile: DatasetProfile | None = None, cells: CellTable | None = None
) -> CellOracle:
    """The estimator for the recipe's model flavors on its data (document lengths from `profile` when given),
    answering from `cells` (the estimate stage's CellTable) for every Cell it priced as the slots' node shape."""
    from omni_core.common.catalog import GpuCatalog
    from omni_core.estimator.oracle import CellOracle
    from omni_core.estimator.recipe_cells import flavor_workload
    from omni_core.estimator.search import cell_shape

    oracle = CellOracle(
        GpuCatalog().with_overrides(recipe.estimate.gpus),
        {t: g.gpus_per_node for t, g in cluster.groups.items()},
        lambda model, batch: flavor_workload(recipe, model, batch, profile),
    )
    if cells is None:
        return oracle
    for job in recipe.jobs:
        for (gpu_type, n), row in cells.best_cells(job.name).items():
            group = cluster.groups.get(gpu_type)
            if group and cell_shape(n, group.gpus_per_node) == (row.nodes, row.gpus_per_node):
                oracle.remember(job.model, job.global_batch, row.cell_result())
    return oracle


def job_checkpoint_dir(recipe: Recipe, job: Job) -> str:
    """The one checkpoint directory of all the job's segments, keyed by the training hash of the job run
    unsplit (one rank, its whole batch as micro-batches of one, all its steps): a rerun of the schedule
    resumes the job or finds it done, and a changed job starts afresh."""
    unsplit = recipe.model_copy(
        update={
            "model": recipe.model.model_copy(update={"flavor": job.model}),
            "data": recipe.data.model_copy(update={"micro_batch": 1}),
            "parallel": ParallelConfig(),
            "train": recipe.train.model_copy(update={"steps": job.iterations, "grad_accum": job.global_batch}),
        }
    )
    root = recipe.train.ckpt_dir or f"{recipe.experiment.output_dir}/{recipe.experiment.name}"
    return f"{root.rstrip('/')}/{job.id}/ckpt-{unsplit.training_hash()}"


def placed_hosts(recipe: Recipe, placement: Placement) -> list[str]:
    """The Slurm names of the nodes a placement holds, when the launch is pinned to them (else empty)."""
    names = recipe.cluster.node_groups[0].hosts if recipe.cluster.node_groups else []
    return [names[i] for i in sorted(set(placement))] if names and recipe.launch.target == "slurm" else []


def job_overrides(
    recipe: Recipe, job: Job, best: Estimate, last_step: int, *, resume: bool, hosts: Sequence[str] = ()
) -> list[str]:
    """The job's training recipe for one segment, as overrides of the base recipe: its own experiment name
    (stage files, registered model) in the base's MLflow experiment and dataset; its model, steps and
    checkpoint directory; the Slurm nodes it was placed on (`hosts`); the estimator's plan, micro-batch and
    activation checkpointing, with the gradient accumulation that keeps its global batch (the search only picks
    micro-batches that divide it)."""
    from omni_core.estimator.recipe_cells import plan_overrides

    values = {
        "experiment.name": f"{recipe.experiment.name}-{job.id}",
        "tracking.experiment": recipe.mlflow_experiment(),
        "tracking.registered_model": f"{recipe.tracking.registered_model or recipe.experiment.name}-{job.id}",
        "data.path": recipe.data_dir(),
        "model.flavor": job.model,
        "train.steps": job.iterations,
        "train.stop_at_step": last_step,
        "train.ckpt_dir": job_checkpoint_dir(recipe, job),
        "train.resume": resume,
        "jobs": [],
        **({"launch.nodes": len(hosts), "launch.nodelist": list(hosts)} if hosts else {}),
    }
    plan = plan_overrides(best.plan, best.options.micro_batch, best.options.checkpoint, job.global_batch)
    return [f"{key}={json.dumps(value)}" for key, value in values.items()] + plan  # JSON is YAML: paths stay strings


@dataclass(frozen=True)
class JobRun:
    """One launch: the base recipe with `overrides` is the job's training recipe for this segment."""

    job: str
    segment: int  # 1 for the job's first launch
    slots: int
    plan: str
    first_step: int  # steps trained before: the checkpoint this launch resumes from
    last_step: int  # train.stop_at_step of this launch
    overrides: tuple[str, ...]
    expected_samples_per_s: float  # what the policy decided on: the oracle's throughput of its plan

    @property
    def name(self) -> str:
        """Its MLflow run and Prefect flow run name."""
        return f"train-{self.job}-{self.segment}"


class JobSegment(Segment):
    """A launch as it ran: the plan of its slots, the steps it covered and where the trainer resumed."""

    segment: int
    first_step: int
    last_step: int  # the trainer's TrainResult.steps
    resumed_from_step: int  # the trainer's own report: first_step when it found the job's checkpoint
    expected_samples_per_s: float
    measured_samples_per_s: float  # of this launch's steps


class Resize(Result):
    job: str
    t_s: float
    step: int  # the checkpoint the job resumed from under the new plan
    from_slots: int
    to_slots: int
    from_plan: str
    to_plan: str


class Decision(Result):
    t_s: float
    trigger: str
    chosen: dict[str, int]  # slots the policy chose per active job (absent: it waits)
    held: dict[str, int]  # slots held after placement: a job inside a segment keeps its slots until it ends
    started: list[str]  # launches started (JobRun.name)
    latency_s: float


class ScheduleRun(Result):
    """What real mode did (the simulator's SchedulePlan, for real): each job's outcome and last TrainResult,
    every segment with its slots and plan, the resizes, and each decision with what triggered it."""

    policy: str
    cluster: dict[str, list[int]]  # slot type -> [nodes, slots per node]
    segment_steps: int
    wall_s: float
    jobs: list[JobRecord]
    segments: list[JobSegment]
    resizes: list[Resize]
    decisions: list[Decision]
    results: dict[str, TrainResult]

    def metrics(self) -> dict[str, float]:
        out = {
            "schedule/wall_s": self.wall_s,
            "schedule/segments": len(self.segments),
            "schedule/resizes": len(self.resizes),
            "schedule/jobs_finished": sum(job.finish_s is not None for job in self.jobs),
        }
        for s in self.segments:  # what each launch's policy expected, and what it got
            out[f"schedule/{s.job}/{s.segment}/expected_samples_per_s"] = s.expected_samples_per_s
            out[f"schedule/{s.job}/{s.segment}/measured_samples_per_s"] = s.measured_samples_per_s
        for job in self.jobs:
            out[f"schedule/{job.id}/reschedules"] = job.reschedules
            if job.finish_s is not None:
                out[f"schedule/{job.id}/jct_s"] = job.finish_s - job.arrival_s
                assert job.start_s is not None, f"job {job.id} finished without starting"
                out[f"schedule/{job.id}/queueing_s"] = job.start_s - job.arrival_s
        return out


def format_run(run: ScheduleRun) -> str:
    """The segments in start order, then the jobs that did not finish."""
    finished = sum(job.finish_s is not None for job in run.jobs)
    slots = ", ".join(f"{nodes * per_node} {t}" for t, (nodes, per_node) in run.cluster.items())
    lines = [
        (
            f"{run.policy} on {slots} slots: {finished}/{len(run.jobs)} jobs finished in {run.wall_s:.0f} s, "
            f"{len(run.resizes)} resize(s)"
        ),
        f"  {'job':<14}{'seg':>4}{'slots':>6}  {'plan':<14}{'steps':>11}{'start s':>9}{'end s':>8}"
        f"{'expected/s':>11}{'got/s':>8}",
    ]
    for s in sorted(run.segments, key=lambda s: (s.start_s, s.job)):
        steps = f"{s.first_step + 1}..{s.last_step}"
        lines.append(
            f"  {s.job:<14}{s.segment:>4}{s.num_gpus:>6}  {s.plan:<14}{steps:>11}"
            f"{s.start_s:>9.1f}{s.end_s:>8.1f}"
            f"{s.expected_samples_per_s:>11.2f}{s.measured_samples_per_s:>8.2f}"
        )
    lines += [f"  {job.id}: not finished" for job in run.jobs if job.finish_s is None]
    return "\n".join(lines)


class LocalScheduler:
    """Real mode's decisions and bookkeeping, without threads or clocks (callers pass `now`): which job
    trains which segment on how many slots, and what happened."""

    def __init__(
        self,
        recipe: Recipe,
        oracle: CellOracle | None = None,
        profile: DatasetProfile | None = None,
        cells: CellTable | None = None,
    ):
        check_recipe(recipe)
        self.recipe = recipe
        self.cluster = real_cluster(recipe)
        self.oracle = oracle or recipe_oracle(recipe, self.cluster, profile, cells)
        self.table = ThroughputTable(self.oracle, self.cluster.capacity(), recipe.schedule.max_gpus_per_job)
        self.policy = make_policy(recipe.schedule.policy).without_search_costs()
        jobs = sorted((Job.from_config(c) for c in recipe.jobs), key=lambda j: (j.arrival_s, j.id))
        self.jobs = {job.id: job for job in jobs}
        self.records = {
            job.id: JobRecord(id=job.id, model=job.model, arrival_s=job.arrival_s, modelled=self.table.modelled(job))
            for job in jobs
        }
        self.arrived: list[str] = []
        self.trained = dict.fromkeys(self.jobs, 0)  # steps per job
        self.running: dict[str, tuple[JobRun, float]] = {}  # launched and not ended: (launch, start time)
        self.segments: list[JobSegment] = []
        self.resizes: list[Resize] = []
        self.decisions: list[Decision] = []
        self.results: dict[str, TrainResult] = {}

    def admit(self, now: float) -> list[str]:
        """The jobs that arrived by `now` since the last call."""
        new = [j for j, job in self.jobs.items() if j not in self.arrived and job.arrival_s <= now]
        self.arrived += new
        return new

    def next_arrival(self) -> float | None:
        return min((job.arrival_s for j, job in self.jobs.items() if j not in self.arrived), default=None)

    def decide(self, now: float, trigger: str) -> list[JobRun]:
        """Ask the policy, place what it chose on the slots that are free of running segments, and return the
        launches to start now: every placed job that is not inside a segment."""
        active = [self.jobs[j] for j in self.arrived if self.records[j].finish_s is None and self.records[j].modelled]
        current = {j: (t, len(nodes)) for j, (t, nodes) in self.cluster.placements.items()}
        remaining = {job.id: float((job.iterations - self.trained[job.id]) * job.global_batch) for job in active}
        tic = time.perf_counter()
        chosen = self.policy.decide(View(now, active, current, remaining, self.table, self.cluster, restart_s=0.0))
        latency = time.perf_counter() - tic
        # a running job cannot move before its boundary: a job the free slots' fragments cannot hold waits
        self.cluster.apply({**chosen, **{j: current[j] for j in self.running}}, migrate=False)
        self.cluster.check()
        for j in current.keys() - self.cluster.placements.keys():
            self.records[j].reschedules += 1  # preempted at its boundary
        launches = [self._launch(j, now) for j in self.cluster.placements if j not in self.running]
        self.decisions.append(
            Decision(
                t_s=now,
                trigger=trigger,
                chosen={j: n for j, (_, n) in chosen.items()},
                held={j: len(nodes) for j, (_, nodes) in self.cluster.placements.items()},
                started=[run.name for run in launches],
                latency_s=latency,
            )
        )
        return launches

    def _launch(self, job_id: str, now: float) -> JobRun:
        job, record = self.jobs[job_id], self.records[job_id]
        gpu_type, placement = self.cluster.placements[job_id]
        best = self.oracle.cell(job.model, job.global_batch, gpu_type, len(placement)).best
        first = self.trained[job_id]
        last = min(first + self.recipe.schedule.segment_steps, job.iterations)
        before = [s for s in self.segments if s.job == job_id]
        overrides = job_overrides(
            self.recipe,
            job,
            best,
            last,
            resume=self.recipe.train.resume or first > 0,
            hosts=placed_hosts(self.recipe, placement),
        )
        run = JobRun(
            job_id, len(before) + 1, len(placement), best.plan.name, first, last, tuple(overrides), best.samples_per_s
        )
        if before and before[-1].num_gpus != run.slots:
            self.resizes.append(
                Resize(
                    job=job_id,
                    t_s=now,
                    step=first,
                    from_slots=before[-1].num_gpus,
                    to_slots=run.slots,
                    from_plan=before[-1].plan,
                    to_plan=run.plan,
                )
            )
            record.reschedules += 1
        if record.start_s is None:
            record.start_s = now
        self.running[job_id] = (run, now)
        return run

    def ended(self, run: JobRun, result: TrainResult, now: float) -> None:
        """Record a finished launch; a job that reached its steps gives its slots back."""
        _, since = self.running.pop(run.job)
        gpu_type, nodes = self.cluster.placements[run.job]
        self.segments.append(
            JobSegment(
                job=run.job,
                gpu_type=gpu_type,
                num_gpus=run.slots,
                nodes=sorted(set(nodes)),
                plan=run.plan,
                start_s=since,
                end_s=now,
                segment=run.segment,
                first_step=run.first_step,
                last_step=result.steps,
                resumed_from_step=result.resumed_from_step,
                expected_samples_per_s=run.expected_samples_per_s,
                measured_samples_per_s=result.launch_samples_per_s,
            )
        )
        self.trained[run.job] = result.steps
        self.results[run.job] = result
        if result.steps >= self.jobs[run.job].iterations:
            self.records[run.job].finish_s = now
            self.cluster.release(run.job)

    def report(self, wall_s: float) -> ScheduleRun:
        return ScheduleRun(
            policy=self.policy.name,
            cluster={t: [g.nodes, g.gpus_per_node] for t, g in self.cluster.groups.items()},
            segment_steps=self.recipe.schedule.segment_steps,
            wall_s=wall_s,
            jobs=list(self.records.values()),
            segments=self.segments,
            resizes=self.resizes,
            decisions=self.decisions,
            results=self.results,
        )


def run_schedule(
    recipe: Recipe,
    train: Callable[[JobRun], TrainResult],
    *,
    profile: DatasetProfile | None = None,
    cells: CellTable | None = None,
    oracle: CellOracle | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> ScheduleRun:
    """Real mode from the first arrival to the last job's end (or until nothing left can run).

    `train` runs one launch and returns when it ends (the schedule flow passes the train flow). Launches run
    concurrently in threads, each in a copy of the caller's context, so Prefect subflows and MLflow child
    runs nest under the caller's. After a failed launch nothing new starts; its error is raised once the
    running launches have ended.
    """
    from omni_core.data.synthetic import ensure_dataset

    scheduler = LocalScheduler(recipe, oracle, profile, cells)
    ensure_dataset(recipe)  # once, before jobs that share it start at the same moment
    start = clock()
    running: dict[Future[TrainResult], JobRun] = {}
    error: BaseException | None = None
    with ThreadPoolExecutor(max_workers=scheduler.cluster.total_gpus) as pool:
        while True:
            now = clock() - start
            triggers = [f"{j} arrived" for j in scheduler.admit(now)]
            for future in [f for f in running if f.done()]:
                run = running.pop(future)
                if future.exception() is not None:
                    error = error or future.exception()
                    continue
                scheduler.ended(run, future.result(), now)
                triggers.append(f"{run.name} ended")
            if triggers and error is None:
                for run in scheduler.decide(now, ", ".join(triggers)):
                    running[pool.submit(contextvars.copy_context().run, train, run)] = run
            arrival = scheduler.next_arrival()
            if not running and (arrival is None or error is not None):
                break
            timeout = None if arrival is None else max(0.0, arrival - (clock() - start))
            if running:
                wait(running, timeout=timeout, return_when=FIRST_COMPLETED)
            else:
                assert timeout is not None  # nothing runs and no job is due: the loop ended above
                time.sleep(timeout)
    if error is not None:
        raise error
    return scheduler.report(clock() - start)
