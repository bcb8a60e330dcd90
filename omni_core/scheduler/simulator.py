"""Round-based event simulator: replays jobs on a cluster under one policy and measures the outcome.

Every `round_s` seconds, if a job arrived or finished since the last decision (every round for a
round-based policy: Gavel, Sia), the policy decides, timed in CPU seconds (`time.process_time`, so a loaded
machine does not inflate it), and the cluster is re-placed; a job whose config or nodes changed, or that
starts, loses what the policy's system pays for that (`Policy.start_s`: the `restart_s` restore, plus plan
search or profiling on a config new to the job) from the next round(s). Between decisions jobs progress at
the best plan's samples/s of the config they hold (vectorised over jobs); a job finishes inside a round
and its GPUs are reused from the next decision. Jobs the oracle cannot model (no config fits, unknown
model) never run and are counted as `unmodelled`.

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
    trace_issues: int
    mean_jct_s: float | None
    p50_jct_s: float | None
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
    wall0, cpu0 = time.perf_counter(), time.process_time()
    order = sorted(jobs, key=lambda j: (j.arrival_s, j.id))
    if len({j.id for j in order}) != len(order):
        raise ValueError("job ids must be unique")
    index = {j.id: i for i, j in enumerate(order)}
    modelled = np.array([table.modelled(j) for j in order], dtype=bool)
    arrival = np.array([j.arrival_s for j in order])
    remaining = np.array([float(j.samples) for j in order])
    rate = np.zeros(len(order))  # samples/s of the config held now
    gpus = np.zeros(len(order))
    stall = np.zeros(len(order))  # restart seconds still to serve
    start = np.full(len(order), np.nan)
    finish = np.full(len(order), np.nan)
    reschedules = np.zeros(len(order), dtype=np.int64)
    active: list[int] = []  # arrived, modelled, unfinished, arrival order
    running: dict[str, _Running] = {}
    segments: list[Segment] = []
    latencies: list[float] = []
    series: dict[str, list[float]] = {k: [] for k in ("t_s", "throughput", "utilisation", "running", "queued")}
    fragmentation: list[float] = []
    t0 = float(arrival[0]) if len(order) else 0.0
    admitted, changed, simulated = 0, True, 0

    def close(job_id: str, now: float) -> None:
        r = running.pop(job_id)
        plan = table.plan(order[index[job_id]], r.config)
        segments.append(
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

    for k in range(rounds):
        now = t0 + k * round_s
        while admitted < len(order) and arrival[admitted] <= now:
            if modelled[admitted]:
                active.append(admitted)
                changed = True
            admitted += 1
        if admitted == len(order) and not active and not fixed_horizon:
            break
        simulated += 1
        if changed or (policy.every_round and active):
            view = View(
                now,
                [order[i] for i in active],
                {j: r.config for j, r in running.items()},
                {order[i].id: remaining[i] for i in active},
                table,
                cluster,
                restart_s,
            )
            tic = time.process_time()
            alloc = policy.decide(view)
            latencies.append(time.process_time() - tic)
            _apply(
                alloc,
                running,
                cluster,
                policy,
                table,
                order,
                index,
                now,
                close,
                rate,
                gpus,
                stall,
                start,
                reschedules,
                restart_s,
            )
            changed = False
        # --- advance one round, vectorised over the active jobs ---
        idx = np.fromiter(active, dtype=np.int64, count=len(active))
        work = np.clip(round_s - stall[idx], 0.0, None)
        done_at = np.where(rate[idx] > 0, stall[idx] + remaining[idx] / np.where(rate[idx] > 0, rate[idx], 1), np.inf)
        ends = done_at <= round_s
        served = np.where(ends, remaining[idx], rate[idx] * work)
        remaining[idx] -= served
        stall[idx] = np.clip(stall[idx] - round_s, 0.0, None)
        series["t_s"].append(now - t0)
        series["throughput"].append(float(served.sum()) / round_s)
        series["utilisation"].append(float(gpus[idx].sum()) / cluster.total_gpus)
        series["running"].append(float(np.count_nonzero(rate[idx])))
        series["queued"].append(float(np.count_nonzero(rate[idx] == 0)))
        fragmentation.append(cluster.fragmentation())
        if ends.any():
            for i, at in zip(idx[ends], done_at[ends]):
                finish[i] = now + at
                remaining[i] = rate[i] = gpus[i] = 0.0
                close(order[i].id, finish[i])
                cluster.release(order[i].id)
            done = set(idx[ends].tolist())
            active = [i for i in active if i not in done]
            changed = True
    end = t0 + simulated * round_s
    for job_id in list(running):
        close(job_id, end)
    cluster.check()
    return SchedulePlan(
        policy=policy.name,
        trace=trace,
        round_s=round_s,
        restart_s=restart_s,
        cluster={t: [g.nodes, g.gpus_per_node] for t, g in cluster.groups.items()},
        metrics=_metrics(
            order,
            arrival,
            start,
            finish,
            modelled,
            reschedules,
            series,
            fragmentation,
            latencies,
            simulated,
            admitted,
            len(issues),
            busy_min_throughput,
            (time.perf_counter() - wall0, time.process_time() - cpu0),
        ),
        jobs=[
            JobRecord(
                id=j.id,
                model=j.model,
                arrival_s=j.arrival_s,
                start_s=_opt(start[i]),
                finish_s=_opt(finish[i]),
                reschedules=int(reschedules[i]),
                modelled=bool(modelled[i]),
            )
            for i, j in enumerate(order)
        ],
        segments=segments,
        series=series,
        issues=list(issues),
    )


def _apply(
    alloc, running, cluster, policy, table, order, index, now, close, rate, gpus, stall, start, reschedules, restart_s
) -> None:
    """Place the policy's decision; charge restarts to started, resized, moved and re-typed jobs."""
    before = {j: (r.config, r.nodes) for j, r in running.items()}
    moved, _ = cluster.apply(alloc, migrate=policy.migrates)  # jobs left out simply stay queued
    for job_id, (config, _) in before.items():
        if job_id not in cluster.placements or alloc.get(job_id) != config or job_id in moved:
            close(job_id, now)
            i = index[job_id]
            reschedules[i] += 1
            rate[i] = gpus[i] = 0.0
    for job_id, (gpu_type, nodes) in cluster.placements.items():
        if job_id in running:
            continue
        i = index[job_id]
        config = (gpu_type, len(nodes))
        running[job_id] = _Running(config, nodes, now)
        rate[i] = table.rate(order[i], config)
        if not np.isfinite(rate[i]):
            raise ValueError(f"policy {policy.name} gave job {job_id} config {config}, where no plan fits")
        gpus[i] = len(nodes)
        stall[i] = policy.start_s(order[i], config, restart_s)
        if np.isnan(start[i]):
            start[i] = now


def _opt(x: float) -> float | None:
    return None if np.isnan(x) else float(x)


def _metrics(
    order,
    arrival,
    start,
    finish,
    modelled,
    reschedules,
    series,
    fragmentation,
    latencies,
    rounds,
    arrived,
    n_issues,
    busy_min,
    seconds,
) -> Metrics:
    done = ~np.isnan(finish)
    jct = (finish - arrival)[done]
    started = ~np.isnan(start)
    lat = np.array(latencies) if latencies else np.zeros(1)
    all_done = bool(done[modelled].all()) and len(order) > 0
    stat = (lambda f: float(f(jct))) if jct.size else (lambda f: None)
    tput = np.array(series["throughput"])
    busy = tput[tput > busy_min]
    return Metrics(
        jobs=len(order),
        arrived=arrived,
        jobs_finished=int(done.sum()),
        unmodelled=int((~modelled).sum()),
        trace_issues=n_issues,
        mean_jct_s=stat(np.mean),
        p50_jct_s=stat(lambda x: np.percentile(x, 50)),
        p99_jct_s=stat(lambda x: np.percentile(x, 99)),
        makespan_s=float(finish[done].max() - arrival.min()) if all_done else None,
        mean_queueing_s=float(np.mean((start - arrival)[started])) if started.any() else None,
        mean_throughput=float(np.mean(tput)) if rounds else 0.0,
        busy_throughput=float(np.mean(busy)) if busy.size else 0.0,
        mean_utilisation=float(np.mean(series["utilisation"])) if rounds else 0.0,
        mean_fragmentation=float(np.mean(fragmentation)) if rounds else 0.0,
        reschedules_per_job=float(reschedules[started].mean()) if started.any() else 0.0,
        decisions=len(latencies),
        p50_decision_s=float(np.percentile(lat, 50)),
        p95_decision_s=float(np.percentile(lat, 95)),
        max_decision_s=float(lat.max()),
        rounds=rounds,
        wall_s=seconds[0],
        cpu_s=seconds[1],
    )
