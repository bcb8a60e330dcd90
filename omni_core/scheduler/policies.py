"""Scheduling policies: each looks at the active jobs once per decision and returns the configuration
(GPU type, GPU count) every job should hold next; the simulator (or real mode) places it on nodes.

- `crius`: greedy maximisation of cluster throughput by marginal gain, starting from what runs now:
  opportunistic starts of queued jobs, growing a running job or changing its GPU type, then shrinking
  running jobs where that lets a waiting job start for a net gain; placement migrates jobs to undo
  fragmentation. A change is worth less by the share of its amortisation window lost to a restart.
- `fcfs`: arrival order, the user's GPU type and count, never preempts or moves a job.
- `gavel`: heterogeneity-aware max-throughput with the user's GPU count, over GPU types only.
- `sia`: elastic and heterogeneity-aware, over every config with a concave utility.
Gavel and Sia solve an exact ILP where the problem is small enough to pay off (`ILP_MAX_VARS`) and use the
greedy otherwise.
As in the Crius paper, the baselines decide with data-parallel throughput; every policy's jobs run with
the best plan of the chosen config (the simulator's job). Values are normalised throughputs
(`ThroughputTable.normalised`, "effective GPUs"), so jobs of different models add up fairly.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from omni_core.scheduler.cluster import Cluster, find_nodes
from omni_core.scheduler.jobs import Config, Job, ThroughputTable

QUEUE_WINDOW = 256  # queued jobs (oldest first) a decision considers: more cannot start on 1,280 GPUs anyway
SHRINK_TRIES = 8  # waiting jobs per decision for which Crius tries shrinking running jobs
AMORTISE_S = 3600.0  # a restart is weighed against at most this much of the job's remaining run
ILP_NODE_LIMIT = 2000  # branch-and-bound nodes, not seconds: a time limit would make runs depend on load
ILP_MAX_VARS = 400  # larger ILPs take HiGHS past a round's latency budget on a loaded cluster
SIA_UTILITY_POWER = 0.5  # concave: a GPU is worth more to a job that has few (Sia's fairness knob)

Cell = tuple[int, int]  # (row in table.gpu_types, column in table.counts)


@dataclass
class View:
    """What a policy sees at one decision."""

    now: float
    jobs: Sequence[Job]  # arrived, unfinished, modelled; in arrival order
    current: Mapping[str, Config]  # configs held now
    remaining: Mapping[str, float]  # samples left per job
    table: ThroughputTable
    cluster: Cluster
    restart_s: float

    def considered(self) -> list[Job]:
        """Running jobs and the oldest QUEUE_WINDOW waiting ones, in arrival order."""
        waiting = 0
        out = []
        for job in self.jobs:
            if job.id not in self.current:
                waiting += 1
                if waiting > QUEUE_WINDOW:
                    continue
            out.append(job)
        return out

    def cell(self, job: Job) -> Cell | None:
        config = self.current.get(job.id)
        return None if config is None else (self.table.gpu_types.index(config[0]), self.table.counts.index(config[1]))

    def discounted(self, job: Job, values: np.ndarray) -> np.ndarray:
        """`values` of a running job with every config but its current one discounted by the restart."""
        cell = self.cell(job)
        if cell is None:
            return values
        run_s = np.minimum(self.remaining[job.id] / self.table.rates(job), AMORTISE_S)
        out = values * np.clip(1.0 - self.restart_s / run_s, 0.0, 1.0)
        out[cell] = values[cell]
        return out


class Policy:
    name = ""
    migrates = True  # may the placement repack a fragmented group (moving jobs)?

    def decide(self, view: View) -> dict[str, Config]:
        raise NotImplementedError


def greedy(values: Sequence[np.ndarray], counts: Sequence[int], capacity: np.ndarray,
           start: Sequence[Cell | None]) -> list[Cell | None]:
    """Greedy by marginal gain per GPU. `values[j][t, c]` is job j's worth on counts[c] GPUs of type t
    (NaN or <= 0: not allowed); jobs start from `start`. Repeatedly take the move (a first config, or a
    more valuable one) with the largest gain per extra GPU that fits in what is free."""
    n = np.asarray(counts, dtype=float)
    held = list(start)
    free = capacity.astype(float).copy()
    for h in held:
        if h is not None:
            free[h[0]] -= n[h[1]]
    version = [0] * len(values)
    heap: list[tuple[float, int, int, int, int]] = []

    def push_moves(j: int) -> None:
        now_v, now_n = (0.0, 0.0) if held[j] is None else (values[j][held[j]], n[held[j][1]])
        delta = values[j] - now_v
        gain = delta / np.maximum(n[None, :] - now_n, 1.0)
        for t, c in zip(*np.nonzero(np.nan_to_num(delta, nan=0.0) > 1e-9)):
            heapq.heappush(heap, (-gain[t, c], j, version[j], int(t), int(c)))

    for j in range(len(values)):
        push_moves(j)
    while heap:
        _, j, ver, t, c = heapq.heappop(heap)
        returned = n[held[j][1]] if held[j] is not None and held[j][0] == t else 0.0
        if ver != version[j] or free[t] + returned < n[c]:
            continue  # stale, or no longer fits (free space only shrinks, except by a type change)
        if held[j] is not None:
            free[held[j][0]] += n[held[j][1]]
        free[t] -= n[c]
        held[j] = (t, c)
        version[j] += 1
        push_moves(j)
    return held


def shrink_to_start(values: Sequence[np.ndarray], counts: Sequence[int], capacity: np.ndarray,
                    held: list[Cell | None], waiting: Sequence[int]) -> None:
    """For each waiting job (in order), halve running jobs of one GPU type, cheapest loss per freed GPU
    first, when the waiting job's value on the freed GPUs exceeds what the halved jobs lose. In place."""
    n = np.asarray(counts)
    for j in waiting:
        free = capacity.astype(float).copy()
        for h in held:
            if h is not None:
                free[h[0]] -= n[h[1]]
        best: tuple[float, int, int, list[int]] | None = None
        for t in range(len(capacity)):
            fits = np.flatnonzero(np.nan_to_num(values[j][t], nan=0.0) > 0)
            if not fits.size:
                continue
            c = int(fits[np.argmax(values[j][t, fits] / n[fits])])
            victims = sorted(
                (i for i, h in enumerate(held) if h is not None and h[0] == t and h[1] > 0
                 and np.nan_to_num(values[i][t, h[1] - 1], nan=0.0) > 0),
                key=lambda i: (values[i][held[i]] - values[i][t, held[i][1] - 1]) / (n[held[i][1]] / 2),
            )
            freed, loss, chosen = free[t], 0.0, []
            for i in victims:
                if freed >= n[c]:
                    break
                freed += n[held[i][1]] / 2
                loss += values[i][held[i]] - values[i][t, held[i][1] - 1]
                chosen.append(i)
            net = values[j][t, c] - loss
            if freed >= n[c] and net > 0 and (best is None or net > best[0]):
                best = (net, t, c, chosen)
        if best is not None:
            _, t, c, chosen = best
            for i in chosen:
                held[i] = (t, held[i][1] - 1)
            held[j] = (t, c)


def _configs(table: ThroughputTable, held: Sequence[Cell | None], jobs: Sequence[Job]) -> dict[str, Config]:
    return {job.id: (table.gpu_types[h[0]], table.counts[h[1]]) for job, h in zip(jobs, held) if h is not None}


class Crius(Policy):
    name = "crius"

    def decide(self, view: View) -> dict[str, Config]:
        jobs = view.considered()
        values = [view.discounted(job, view.table.normalised(job)) for job in jobs]
        start = [view.cell(job) for job in jobs]
        held = greedy(values, view.table.counts, view.table.capacity, start)
        waiting = [j for j, h in enumerate(held) if h is None][:SHRINK_TRIES]
        if waiting:
            shrink_to_start(values, view.table.counts, view.table.capacity, held, waiting)
            held = greedy(values, view.table.counts, view.table.capacity, held)  # hand out what shrinking left over
        return _configs(view.table, held, jobs)


def requested_count(job: Job, table: ThroughputTable, rates: np.ndarray) -> int | None:
    """The user's GPU count (rounded up to a power of two) as a column of the table; without one, the
    smallest count where some plan fits."""
    if job.num_gpus is not None:
        want = 1 << (job.num_gpus - 1).bit_length()
        return table.counts.index(want) if want in table.counts else None
    fits = np.flatnonzero(np.isfinite(rates).any(axis=0))
    return int(fits[0]) if fits.size else None


class Gavel(Policy):
    name = "gavel"

    def decide(self, view: View) -> dict[str, Config]:
        jobs = view.considered()
        values = []
        for job in jobs:
            dp = view.table.normalised(job, dp_only=True)
            v = np.full_like(dp, np.nan)
            c = requested_count(job, view.table, dp)
            if c is not None:
                v[:, c] = view.discounted(job, dp)[:, c]
            values.append(v)
        return _solve(view, jobs, values)


class Sia(Policy):
    name = "sia"

    def decide(self, view: View) -> dict[str, Config]:
        jobs = view.considered()
        values = [view.discounted(job, view.table.normalised(job, dp_only=True) ** SIA_UTILITY_POWER) for job in jobs]
        return _solve(view, jobs, values)


def _solve(view: View, jobs: Sequence[Job], values: Sequence[np.ndarray]) -> dict[str, Config]:
    """The exact ILP where it is small enough to pay off within a round, the greedy otherwise."""
    size = sum(int(np.isfinite(v).sum()) for v in values)
    held = _ilp(values, np.asarray(view.table.counts), view.table.capacity) if 0 < size <= ILP_MAX_VARS else None
    if held is None:
        held = greedy(values, view.table.counts, view.table.capacity, [view.cell(job) for job in jobs])
    return _configs(view.table, held, jobs)


def _ilp(values: Sequence[np.ndarray], counts: np.ndarray, capacity: np.ndarray) -> list[Cell | None] | None:
    """max sum value x  s.t. one config per job, GPUs per type <= capacity; None if HiGHS proves no optimum
    within ILP_NODE_LIMIT nodes."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    var = [(j, int(t), int(c)) for j, v in enumerate(values) for t, c in zip(*np.nonzero(np.nan_to_num(v, nan=0.0) > 0))]
    if not var:
        return [None] * len(values)
    job_of, type_of, count_of = (np.array(col) for col in zip(*var))
    idx = np.arange(len(var))
    a = coo_matrix(
        (np.concatenate([np.ones(len(var)), counts[count_of].astype(float)]),
         (np.concatenate([job_of, len(values) + type_of]), np.concatenate([idx, idx]))),
        shape=(len(values) + len(capacity), len(var)),
    )
    gain = np.array([values[j][t, c] for j, t, c in var])
    res = milp(-gain, constraints=LinearConstraint(a.tocsr(), -np.inf, np.concatenate([np.ones(len(values)), capacity])),
               integrality=np.ones(len(var)), bounds=Bounds(0, 1), options={"node_limit": ILP_NODE_LIMIT})
    if res.x is None or res.status != 0:
        return None
    held: list[Cell | None] = [None] * len(values)
    for k in np.flatnonzero(res.x > 0.5):
        held[job_of[k]] = (int(type_of[k]), int(count_of[k]))
    return held


class Fcfs(Policy):
    name = "fcfs"
    migrates = False

    def decide(self, view: View) -> dict[str, Config]:
        alloc = dict(view.current)
        free = {t: view.cluster.free[t].copy() for t in view.table.gpu_types}
        for job in view.jobs:
            if job.id in alloc or job.gpu_type not in free:
                continue
            rates = view.table.rates(job)
            c = requested_count(job, view.table, rates)
            if c is None or not np.isfinite(rates[view.table.gpu_types.index(job.gpu_type), c]):
                continue  # the user's request cannot run this model: it waits (reported unfinished)
            nodes = find_nodes(free[job.gpu_type], view.cluster.groups[job.gpu_type].gpus_per_node, view.table.counts[c])
            if nodes is not None:
                np.subtract.at(free[job.gpu_type], list(nodes), 1)
                alloc[job.id] = (job.gpu_type, view.table.counts[c])
        return alloc


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Crius, Fcfs, Gavel, Sia)}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (choose from {sorted(POLICIES)})") from None
