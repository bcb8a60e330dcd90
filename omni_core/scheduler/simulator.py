"""Round-based event simulator: replays jobs on a cluster under one policy and measures the outcome.

Every `round_s` seconds, if a job arrived or finished since the last decision (every round for a
round-based policy: Gavel, Sia), the policy decides, timed in CPU seconds (`time.process_time`, so a loaded
machine does not inflate it), and the cluster is re-placed; a job whose config or nodes changed, or that
starts, loses what the policy's system pays for that (`Policy.start_s`: the `restart_s` restore, plus plan
search on a config new to the job) from the next round(s). A policy whose source decides more often
(`Policy.round_s`: Sia's minute) decides that often inside each round. Between decisions jobs progress at
the best plan's samples/s of the config they hold (vectorised over jobs); a job finishes inside a round
and its GPUs are reused from the next decision. Jobs the oracle cannot model (no config fits, unknown
model) never run and are counted as `unmodelled`; jobs the policy can never give a config (`Policy.admits`:
its memory rule, its user's request) never queue and are counted as `never_admitted`, the unmodelled ones
included.

Two averages of cluster throughput: `mean_throughput` over every simulated round, and `busy_throughput`
over the rounds above `busy_min_throughput` samples/s, the Crius artifact's figure (its plot script averages
the rounds above 100 samples/s). With `fixed_horizon` every policy runs exactly `rounds` rounds, as the
artifact does, instead of stopping when the last job ends, so a policy is not averaged over a different span.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import Field

from omni_core.common.results import Result
from omni_core.scheduler.cluster import Cluster
from omni_core.scheduler.jobs import Config, Job, ThroughputTable
from omni_core.scheduler.policies.base import Policy, View


class Segment(Result):
    """One job on one config from `start_s` to `end_s` (what the Gantt chart and real mode read)."""

    job: str
    gpu_type: str
    num_gpus: int
    nodes: list[int]
    plan: str
    start_s: float
    end_s: float


class JobRecord(Result):
    id: str
    model: str
    arrival_s: float
    start_s: float | None = None
    finish_s: float | None = None
    reschedules: int = 0  # config changes, migrations and preemptions after the first start
    modelled: bool = True


class Metrics(Result):
    jobs: int
    arrived: int  # jobs that arrived before the horizon
    jobs_finished: int
    unmodelled: int
    never_admitted: int  # arrived jobs the policy can never give a config (the unmodelled included)
    trace_issues: int
    mean_jct_s: float | None
    p50_jct_s: float | None
    p95_jct_s: float | None
    p99_jct_s: float | None
    makespan_s: float | None  # first arrival to last completion; None when not every job finished
    mean_queueing_s: float | None
    mean_throughput: float  # cluster samples/s, mean over the simulated rounds
    busy_throughput: float  # cluster samples/s, mean over the rounds above busy_min_throughput (0: none)
    mean_utilisation: float  # share of GPUs held by jobs
    mean_fragmentation: float
    reschedules_per_job: float
    decisions: int
    p50_decision_s: float
    p95_decision_s: float
    max_decision_s: float
    rounds: int
    wall_s: float
    cpu_s: float  # CPU seconds of the whole simulation (process_time)


class SchedulePlan(Result):
    """A simulated (or planned) schedule: per-job outcome, config segments and time series."""

    policy: str
    trace: str
    cluster: dict[str, list[int]]  # GPU type -> [nodes, GPUs per node]
    round_s: float
    restart_s: float
    metrics: Metrics
    jobs: list[JobRecord]
    segments: list[Segment]
    series: dict[str, list[float]]  # t_s, throughput, utilisation, running, queued per round
    issues: list[str] = Field(default_factory=list)


@dataclass
class _Running:
    config: Config
    nodes: tuple[int, ...]
    since: float


def simulate(
    jobs: Sequence[Job],
    cluster: Cluster,
    policy: Policy,
    table: ThroughputTable,
    *,
    round_s: float = 300.0,
    rounds: int = 2000,
    restart_s: float = 60.0,
    trace: str = "",
    issues: Sequence[str] = (),
    fixed_horizon: bool = False,
    busy_min_throughput: float = 100.0,
) -> SchedulePlan:
    """Replay `jobs` on `cluster` under `policy` for at most `rounds` rounds of `round_s` seconds (see the
    module docstring); `trace` and `issues` are recorded in the plan as given."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    order = sorted(jobs, key=lambda j: (j.arrival_s, j.id))
    if len({j.id for j in order}) != len(order):
        raise ValueError("job ids must be unique")
    steps = decisions_per_round(policy, round_s)
    replay = _Replay(order, cluster, policy, table, restart_s)
    simulated = 0
    for k in range(rounds):
        now = replay.t0 + k * round_s
        replay.admit_arrivals(now)
        if replay.drained() and not fixed_horizon:
            break
        simulated += 1
        replay.round(now, round_s, steps)
    replay.close_all(replay.t0 + simulated * round_s)
    cluster.check()
    return SchedulePlan(
        policy=policy.name,
        trace=trace,
        round_s=round_s,
        restart_s=restart_s,
        cluster={t: [g.nodes, g.gpus_per_node] for t, g in cluster.groups.items()},
        metrics=replay.metrics(
            simulated, len(issues), busy_min_throughput, (time.perf_counter() - wall0, time.process_time() - cpu0)
        ),
        jobs=replay.job_records(),
        segments=replay.segments,
        series=replay.series,
        issues=list(issues),
    )


def decisions_per_round(policy: Policy, round_s: float) -> int:
    """How many times `policy` decides in a round: once, or as often as its own source's round asks."""
    if policy.round_s is None:
        return 1
    steps = round_s / policy.round_s
    if steps < 1 or steps != round(steps):
        raise ValueError(
            f"schedule.round_s={round_s:g} is not a multiple of {policy.name}'s own {policy.round_s:g} s round"
        )
    return int(steps)


class _Replay:
    """One simulation's state, per job in arrival order (the index into every array), and the steps of a
    round that change it; `simulate` runs the rounds. Arrays, so that progress is vectorised over jobs."""

    def __init__(
        self, order: Sequence[Job], cluster: Cluster, policy: Policy, table: ThroughputTable, restart_s: float
    ):
        self.order, self.cluster, self.policy, self.table, self.restart_s = order, cluster, policy, table, restart_s
        self.index = {j.id: i for i, j in enumerate(order)}
        self.modelled = np.array([table.modelled(j) for j in order], dtype=bool)
        self.admissible = np.array([m and policy.admits(j, table) for j, m in zip(order, self.modelled)], dtype=bool)
        self.arrival = np.array([j.arrival_s for j in order])
        self.remaining = np.array([float(j.samples) for j in order])
        self.rate = np.zeros(len(order))  # samples/s of the config held now
        self.gpus = np.zeros(len(order))
        self.stall = np.zeros(len(order))  # restart seconds still to serve
        self.start = np.full(len(order), np.nan)
        self.finish = np.full(len(order), np.nan)
        self.reschedules = np.zeros(len(order), dtype=np.int64)
        self.active: list[int] = []  # arrived, modelled, unfinished, arrival order
        self.running: dict[str, _Running] = {}
        self.segments: list[Segment] = []
        self.latencies: list[float] = []
        self.series: dict[str, list[float]] = {k: [] for k in ("t_s", "throughput", "utilisation", "running", "queued")}
        self.fragmentation: list[float] = []
        self.t0 = float(self.arrival[0]) if len(order) else 0.0
        self.admitted = 0  # jobs arrived so far (a prefix of `order`)
        self.changed = True  # a job arrived or ended since the last decision

    def admit_arrivals(self, now: float) -> None:
        """Jobs that arrived by `now` join the active ones (those the policy can never admit never do)."""
        while self.admitted < len(self.order) and self.arrival[self.admitted] <= now:
            if self.admissible[self.admitted]:
                self.active.append(self.admitted)
                self.changed = True
            self.admitted += 1

    def drained(self) -> bool:
        """Every job has arrived and none is left to run."""
        return self.admitted == len(self.order) and not self.active

    def round(self, now: float, round_s: float, steps: int) -> None:
        """One round in `steps` equal steps, each with the policy's decision where due, then training; the
        round's point of every series, measured over its steps."""
        step_s = round_s / steps
        served = gpu_s = running = queued = 0.0
        for s in range(steps):
            at = now + s * step_s
            if s:
                self.admit_arrivals(at)
            if self.changed or (self.policy.every_round and self.active):
                self.decide(at)
            idx, got, done_at = self.progress(step_s)
            served += float(got.sum())
            gpu_s += float(self.gpus[idx].sum()) * step_s
            if not s:  # counts and fragmentation as the round's decision left them
                running = float(np.count_nonzero(self.rate[idx]))
                queued = float(len(idx)) - running
                self.fragmentation.append(self.cluster.fragmentation())
            self.complete(at, idx, done_at, step_s)
        self.series["t_s"].append(now - self.t0)
        self.series["throughput"].append(served / round_s)
        self.series["utilisation"].append(gpu_s / round_s / self.cluster.total_gpus)
        self.series["running"].append(running)
        self.series["queued"].append(queued)

    def decide(self, now: float) -> None:
        """The policy's decision on what it sees now, timed in CPU seconds, then placed."""
        view = View(
            now,
            [self.order[i] for i in self.active],
            {j: r.config for j, r in self.running.items()},
            {self.order[i].id: self.remaining[i] for i in self.active},
            self.table,
            self.cluster,
            self.restart_s,
        )
        tic = time.process_time()
        alloc = self.policy.decide(view)
        self.latencies.append(time.process_time() - tic)
        self.apply(alloc, now)
        self.changed = False

    def apply(self, alloc: dict[str, Config], now: float) -> None:
        """Place the policy's decision; charge restarts to started, resized, moved and re-typed jobs."""
        before = {j: (r.config, r.nodes) for j, r in self.running.items()}
        moved, _ = self.cluster.apply(alloc, migrate=self.policy.migrates)  # jobs left out simply stay queued
        for job_id, (config, _) in before.items():
            if job_id not in self.cluster.placements or alloc.get(job_id) != config or job_id in moved:
                self.close(job_id, now)
                i = self.index[job_id]
                self.reschedules[i] += 1
                self.rate[i] = self.gpus[i] = 0.0
        for job_id, (gpu_type, nodes) in self.cluster.placements.items():
            if job_id in self.running:
                continue
            i = self.index[job_id]
            config = (gpu_type, len(nodes))
            self.running[job_id] = _Running(config, nodes, now)
            self.rate[i] = self.table.rate(self.order[i], config)
            if not np.isfinite(self.rate[i]):
                raise ValueError(f"policy {self.policy.name} gave job {job_id} config {config}, where no plan fits")
            self.gpus[i] = len(nodes)
            self.stall[i] = self.policy.start_s(self.order[i], config, self.restart_s)
            if np.isnan(self.start[i]):
                self.start[i] = now

    def progress(self, round_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One round of training, vectorised over the active jobs: their indices, the samples each served,
        and when in the round each would finish (inf: not while it holds no GPUs)."""
        idx = np.fromiter(self.active, dtype=np.int64, count=len(self.active))
        rate, stall, remaining = self.rate[idx], self.stall[idx], self.remaining[idx]
        work = np.clip(round_s - stall, 0.0, None)
        done_at = np.where(rate > 0, stall + remaining / np.where(rate > 0, rate, 1), np.inf)
        served = np.where(done_at <= round_s, remaining, rate * work)
        self.remaining[idx] -= served
        self.stall[idx] = np.clip(stall - round_s, 0.0, None)
        return idx, served, done_at

    def complete(self, now: float, idx: np.ndarray, done_at: np.ndarray, round_s: float) -> None:
        """Jobs that finished inside the round: their finish time, segment closed, GPUs released."""
        ends = done_at <= round_s
        if not ends.any():
            return
        for i, at in zip(idx[ends], done_at[ends]):
            self.finish[i] = now + at
            self.remaining[i] = self.rate[i] = self.gpus[i] = 0.0
            self.close(self.order[i].id, self.finish[i])
            self.cluster.release(self.order[i].id)
        done = set(idx[ends].tolist())
        self.active = [i for i in self.active if i not in done]
        self.changed = True

    def close(self, job_id: str, now: float) -> None:
        """End the job's current segment (it stopped, moved or finished)."""
        r = self.running.pop(job_id)
        plan = self.table.plan(self.order[self.index[job_id]], r.config)
        self.segments.append(
            Segment(
                job=job_id,
                gpu_type=r.config[0],
                num_gpus=r.config[1],
                nodes=sorted(set(r.nodes)),
                plan=plan.name if plan is not None else "",
                start_s=r.since,
                end_s=now,
            )
        )

    def close_all(self, end: float) -> None:
        for job_id in list(self.running):
            self.close(job_id, end)

    def job_records(self) -> list[JobRecord]:
        return [
            JobRecord(
                id=j.id,
                model=j.model,
                arrival_s=j.arrival_s,
                start_s=_opt(self.start[i]),
                finish_s=_opt(self.finish[i]),
                reschedules=int(self.reschedules[i]),
                modelled=bool(self.modelled[i]),
            )
            for i, j in enumerate(self.order)
        ]

    def metrics(self, rounds: int, n_issues: int, busy_min: float, seconds: tuple[float, float]) -> Metrics:
        """The run's `Metrics` over `rounds` simulated rounds; `seconds`: (wall, CPU) of the whole run."""
        arrival, start, finish, modelled = self.arrival, self.start, self.finish, self.modelled
        done = ~np.isnan(finish)
        jct = (finish - arrival)[done]
        started = ~np.isnan(start)
        lat = np.array(self.latencies) if self.latencies else np.zeros(1)
        all_done = bool(done[modelled].all()) and len(self.order) > 0
        stat = (lambda f: float(f(jct))) if jct.size else (lambda f: None)
        tput = np.array(self.series["throughput"])
        busy = tput[tput > busy_min]
        return Metrics(
            jobs=len(self.order),
            arrived=self.admitted,
            jobs_finished=int(done.sum()),
            unmodelled=int((~modelled).sum()),
            never_admitted=int((~self.admissible[: self.admitted]).sum()),
            trace_issues=n_issues,
            mean_jct_s=stat(np.mean),
            p50_jct_s=stat(lambda x: np.percentile(x, 50)),
            p95_jct_s=stat(lambda x: np.percentile(x, 95)),
            p99_jct_s=stat(lambda x: np.percentile(x, 99)),
            makespan_s=float(finish[done].max() - arrival.min()) if all_done else None,
            mean_queueing_s=float(np.mean((start - arrival)[started])) if started.any() else None,
            mean_throughput=float(np.mean(tput)) if rounds else 0.0,
            busy_throughput=float(np.mean(busy)) if busy.size else 0.0,
            mean_utilisation=float(np.mean(self.series["utilisation"])) if rounds else 0.0,
            mean_fragmentation=float(np.mean(self.fragmentation)) if rounds else 0.0,
            reschedules_per_job=float(self.reschedules[started].mean()) if started.any() else 0.0,
            decisions=len(self.latencies),
            p50_decision_s=float(np.percentile(lat, 50)),
            p95_decision_s=float(np.percentile(lat, 95)),
            max_decision_s=float(lat.max()),
            rounds=rounds,
            wall_s=seconds[0],
            cpu_s=seconds[1],
        )


def _opt(x: float) -> float | None:
    return None if np.isnan(x) else float(x)
