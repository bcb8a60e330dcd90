"""Scheduling policies: each looks at the active jobs at a decision and returns the configuration (GPU type,
GPU count) every job should hold next; the simulator (or real mode) places it on nodes and charges each
(re)start what the policy's system pays for it (`Policy.start_s`).

- `crius`: greedy maximisation of cluster throughput by marginal gain, starting from what runs now:
  opportunistic starts of queued jobs, growing a running job or changing its GPU type, then shrinking
  running jobs where that lets a waiting job start for a net gain; placement migrates jobs to undo
  fragmentation. A change is worth less by the share of its amortisation window lost to a restart; a
  waiting job is worth more by its response ratio (waited + run) / run, so admission under contention does
  not hang on the shrink's throughput gain alone and no job waits unboundedly.
- `fcfs`: arrival order, the user's GPU type and count, never preempts or moves a job.
- `gavel` (Narayanan et al., OSDI 2020): heterogeneity-aware max-min fairness over effective throughput, an
  LP over each job's time share of every GPU type at the user's GPU count, realised by round-based time
  slicing (each round, the jobs furthest behind their share get GPUs first).
- `sia` (Jayaram Subramanya et al., SOSP 2023): an ILP per round over (GPU type, count) on bootstrapped
  throughput estimates, with its restart factor, profiling of unseen configurations and no preemption of
  admitted jobs.
As in the Crius paper, the baselines decide with data-parallel throughput; every policy's jobs run with the
best plan of the chosen config (the simulator's job), and every baseline pays for searching that plan
without Crius's Cell pruning. Values are normalised throughputs (`ThroughputTable.normalised`, "effective
GPUs"), so jobs of different models add up fairly. Costs and limits are constructor parameters; their
defaults cite where they come from (the Crius artifact: github.com/sjtu-epcc/arena, branch ae-eurosys,
`macro/macro_def.py` and `baselines/sia_sched.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from omni_core.scheduler.cluster import Cluster, find_nodes
from omni_core.scheduler.jobs import Config, Job, ThroughputTable

AMORTISE_S = 3600.0  # a restart is weighed against at most this much of the job's remaining run
# Sia's ILP solve: branch-and-bound nodes, not seconds (a time limit would make runs depend on load).
ILP_OPTIONS = {"node_limit": 2000}
# Plan search on a config new to the job, per GPU and capped (Crius artifact macro_def.py): Crius's pruned
# Cells (RESCHED_OVERHEAD_WITH_PRUNE, MAX_RESCHED_OVERHEAD_WITH_PRUNE) and the baselines' unpruned search
# (RESCHED_OVERHEAD_WITHOUT_PRUNE, MAX_RESCHED_OVERHEAD_WITHOUT_PRUNE).
CRIUS_SEARCH_S = (10.0, 40.0)
UNPRUNED_SEARCH_S = (150.0, 600.0)

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

    def considered(self, window: int) -> list[Job]:
        """Running jobs and the oldest `window` waiting ones, in arrival order."""
        waiting = 0
        out = []
        for job in self.jobs:
            if job.id not in self.current:
                waiting += 1
                if waiting > window:
                    continue
            out.append(job)
        return out

    def cell(self, job: Job) -> Cell | None:
        config = self.current.get(job.id)
        return None if config is None else (self.table.gpu_types.index(config[0]), self.table.counts.index(config[1]))

    def run_s(self, job: Job) -> np.ndarray:
        """Seconds the job's remaining samples take on every config (NaN where it does not fit)."""
        return self.remaining[job.id] / self.table.rates(job)


class Policy:
    """A policy decides configs (`decide`) and says what a (re)start costs under its system (`start_s`);
    the simulator charges that, so each policy pays for its own design, on the same oracle."""

    name = ""
    migrates = True  # may the placement repack a fragmented group (moving jobs)?
    every_round = False  # decide every round (round-based policies), not only when a job arrives or ends

    def __init__(self, search_s_per_gpu: float = UNPRUNED_SEARCH_S[0], search_max_s: float = UNPRUNED_SEARCH_S[1]):
        self.search_s_per_gpu = search_s_per_gpu
        self.search_max_s = search_max_s
        self._ran: set[tuple[str, Config]] = set()

    def decide(self, view: View) -> dict[str, Config]:
        raise NotImplementedError

    def without_search_costs(self) -> Policy:
        """The policy as real mode runs it: omni's estimator answers a plan search (or a profile) at once, and
        a launch's own restore is what it measures, so no start is charged more."""
        self.search_s_per_gpu = self.search_max_s = 0.0
        return self

    def search_s(self, n_gpus):
        """Seconds to find the best plan on `n_gpus` GPUs of a config the job never ran on."""
        return np.minimum(self.search_s_per_gpu * np.asarray(n_gpus, dtype=float), self.search_max_s)

    def start_s(self, job: Job, config: Config, restart_s: float) -> float:
        """Seconds `job` loses starting on `config`: the checkpoint restore every policy pays, and the plan
        search the first time the job runs on that config (a found plan is kept)."""
        new = (job.id, config) not in self._ran
        self._ran.add((job.id, config))
        return restart_s + (float(self.search_s(config[1])) if new else 0.0)


def greedy(
    values: Sequence[np.ndarray], counts: Sequence[int], capacity: np.ndarray, start: Sequence[Cell | None]
) -> list[Cell | None]:
    """Greedy by marginal gain per GPU. `values[j][t, c]` is job j's worth on counts[c] GPUs of type t
    (NaN or <= 0: not allowed); jobs start from `start`. Repeatedly take the move (a first config, or a
    more valuable one) with the largest gain per extra GPU that fits in what is free. Moves are queued per
    GPU type and a type with no free GPU is passed over (until a type change frees one), so a full cluster
    does not pop every queued move one by one."""
    n = np.asarray(counts, dtype=float)
    held = list(start)
    free = capacity.astype(float).copy()
    for h in held:
        if h is not None:
            free[h[0]] -= n[h[1]]
    version = [0] * len(values)
    heaps = _first_moves(values, n, held, len(capacity))

    def moves(j: int):
        now_v, now_n = (0.0, 0.0) if held[j] is None else (values[j][held[j]], n[held[j][1]])
        delta = values[j] - now_v
        gain = delta / np.maximum(n[None, :] - now_n, 1.0)
        for t, c in zip(*np.nonzero(np.nan_to_num(delta, nan=0.0) > 1e-9)):
            yield int(t), (-gain[t, c], j, version[j], int(c))

    while True:
        live = [t for t, h in enumerate(heaps) if h and free[t] > 0]
        if not live:
            return held
        t = min(live, key=lambda k: heaps[k][0])
        _, j, ver, c = heapq.heappop(heaps[t])
        returned = n[held[j][1]] if held[j] is not None and held[j][0] == t else 0.0
        if ver != version[j] or free[t] + returned < n[c]:
            continue  # stale, or no longer fits
        if held[j] is not None:
            free[held[j][0]] += n[held[j][1]]
        free[t] -= n[c]
        held[j] = (t, c)
        version[j] += 1
        for k, move in moves(j):
            heapq.heappush(heaps[k], move)


def _first_moves(
    values: Sequence[np.ndarray], n: np.ndarray, held: Sequence[Cell | None], types: int
) -> list[list[tuple[float, int, int, int]]]:
    """Every job's moves from where it starts, one heap per GPU type, computed for all jobs at once (the
    per-job loop was most of a large decision's cost): (-gain per extra GPU, job, version 0, count)."""
    heaps: list[list[tuple[float, int, int, int]]] = [[] for _ in range(types)]
    if not values:
        return heaps
    v = np.stack(values)
    rows = np.arange(len(values))
    cells = np.array([h if h is not None else (0, 0) for h in held]).reshape(-1, 2)
    running = np.array([h is not None for h in held])
    now_v = np.where(running, v[rows, cells[:, 0], cells[:, 1]], 0.0)
    now_n = np.where(running, n[cells[:, 1]], 0.0)
    delta = v - now_v[:, None, None]
    gain = delta / np.maximum(n[None, None, :] - now_n[:, None, None], 1.0)
    j, t, c = np.nonzero(np.nan_to_num(delta, nan=0.0) > 1e-9)
    for k in range(types):
        on = t == k
        heaps[k] = list(zip((-gain[j[on], k, c[on]]).tolist(), j[on].tolist(), [0] * int(on.sum()), c[on].tolist()))
        heapq.heapify(heaps[k])
    return heaps


def shrink_to_start(
    values: Sequence[np.ndarray],
    counts: Sequence[int],
    capacity: np.ndarray,
    held: list[Cell | None],
    waiting: Sequence[int],
) -> None:
    """For each waiting job (in the order given), halve running jobs of one GPU type, cheapest loss per freed
    GPU first, and start it on the count of that type with the largest net gain (its value there minus what
    the halved jobs lose), if any is positive. In place. Free GPUs and one heap of halving candidates per
    type are kept across the waiting jobs, so a try costs the victims it looks at, not a pass over every
    running job."""
    n = np.asarray(counts)
    free = capacity.astype(float).copy()
    for h in held:
        if h is not None:
            free[h[0]] -= n[h[1]]
    heaps: list[list[tuple[float, int, Cell]]] = [[] for _ in capacity]

    def push(i: int) -> None:
        t, c = held[i]
        if c > 0 and np.nan_to_num(values[i][t, c - 1], nan=0.0) > 0:
            heapq.heappush(heaps[t], ((values[i][t, c] - values[i][t, c - 1]) / (n[c] / 2), i, (t, c)))

    for i, h in enumerate(held):
        if h is not None:
            push(i)
    for j in waiting:
        tries = [_shrink_try(values[j][t], n, free[t], heaps[t], held) for t in range(len(capacity))]
        best = max(range(len(tries)), key=lambda t: tries[t][0])
        for t, (net, c, taken, rest) in enumerate(tries):
            for entry in rest if t == best and net > 0 else taken + rest:
                heapq.heappush(heaps[t], entry)
        net, c, taken, _ = tries[best]
        if net > 0:
            for _, i, (_, ci) in taken:
                held[i] = (best, ci - 1)
                free[best] += n[ci] / 2
                push(i)
            held[j] = (best, c)
            free[best] -= n[c]


def _shrink_try(value: np.ndarray, n: np.ndarray, free: float, heap: list, held: list[Cell | None]):
    """The best start of a waiting job worth `value` per count on one type by halving victims from `heap`:
    (net gain, count, victims it halves, victims popped beyond those). Victims are popped, not kept: the
    caller pushes back what it does not halve."""
    freed, loss, popped = free, 0.0, []
    best = (0.0, -1, 0)  # net, count, victims
    for c in np.flatnonzero(np.nan_to_num(value, nan=0.0) > 0):
        while freed < n[c] and heap:
            entry = heapq.heappop(heap)
            if held[entry[1]] != entry[2]:
                continue  # stale: that job was halved already
            popped.append(entry)
            freed += n[entry[2][1]] / 2
            loss += entry[0] * n[entry[2][1]] / 2
        if freed < n[c]:
            break
        if value[c] - loss > best[0]:
            best = (value[c] - loss, int(c), len(popped))
    return best[0], best[1], popped[: best[2]], popped[best[2] :]


def _configs(table: ThroughputTable, held: Sequence[Cell | None], jobs: Sequence[Job]) -> dict[str, Config]:
    return {job.id: (table.gpu_types[h[0]], table.counts[h[1]]) for job, h in zip(jobs, held) if h is not None}


class Crius(Policy):
    """Crius (the Crius paper's scheduler) with a response-ratio admission term for waiting jobs.

    `queue_window_per_gpu`: waiting jobs a decision considers, per GPU of the cluster (0.2: the 256 oldest on
    the study's 1,280 GPUs, more than can start at once), so the limit grows with the cluster; never fewer
    than `queue_window_min` (a small cluster's decisions are cheap, and its queue may be long)."""

    name = "crius"

    def __init__(
        self,
        search_s_per_gpu: float = CRIUS_SEARCH_S[0],
        search_max_s: float = CRIUS_SEARCH_S[1],
        queue_window_per_gpu: float = 0.2,
        queue_window_min: int = 256,
    ):
        super().__init__(search_s_per_gpu, search_max_s)
        self.queue_window_per_gpu, self.queue_window_min = queue_window_per_gpu, queue_window_min

    def decide(self, view: View) -> dict[str, Config]:
        jobs = view.considered(max(self.queue_window_min, int(self.queue_window_per_gpu * view.cluster.total_gpus)))
        values = [self.value(view, job) for job in jobs]
        counts, capacity = view.table.counts, view.table.capacity
        held = greedy(values, counts, capacity, [view.cell(job) for job in jobs])
        per_gpu = np.asarray(counts, dtype=float)
        waiting = sorted(
            (j for j, h in enumerate(held) if h is None),
            key=lambda j: -np.nanmax(np.nan_to_num(values[j], nan=0.0) / per_gpu),
        )
        if waiting:
            shrink_to_start(values, counts, capacity, held, waiting)
            held = greedy(values, counts, capacity, held)  # hand out what shrinking left over
        return _configs(view.table, held, jobs)

    def value(self, view: View, job: Job) -> np.ndarray:
        """Normalised throughput per config. A running job's other configs lose the share of their
        amortisation window a restart (restore and plan search) takes; a waiting job's configs gain its
        response ratio, 1 + waited / remaining run on its most GPU-efficient config: no extra while it has
        not waited, growing with the wait and larger for short jobs (highest-response-ratio-next), so every
        waiting job is admitted eventually, short ones first. One factor for all its configs, so which count
        it gets is still a question of throughput."""
        values = view.table.normalised(job)
        run_s = view.run_s(job)
        cell = view.cell(job)
        if cell is None:
            efficient = np.nanargmax(values / np.asarray(view.table.counts, dtype=float)[None, :])
            return values * (1.0 + max(view.now - job.arrival_s, 0.0) / run_s.flat[efficient])
        restart = view.restart_s + self.search_s(view.table.counts)[None, :]
        out = values * np.clip(1.0 - restart / np.minimum(run_s, AMORTISE_S), 0.0, 1.0)
        out[cell] = values[cell]
        return out


def requested_count(job: Job, table: ThroughputTable, rates: np.ndarray) -> int | None:
    """The user's GPU count (rounded up to a power of two) as a column of the table; without one, the
    smallest count where some plan fits."""
    if job.num_gpus is not None:
        want = 1 << (job.num_gpus - 1).bit_length()
        return table.counts.index(want) if want in table.counts else None
    fits = np.flatnonzero(np.isfinite(rates).any(axis=0))
    return int(fits[0]) if fits.size else None


class Gavel(Policy):
    """Gavel's max-min fairness over effective throughput (Narayanan et al., OSDI 2020, section 4).

    Whenever the set of jobs changes, an LP gives every job a time share X[j, t] of each GPU type at its
    requested GPU count (Gavel never changes counts), maximising the smallest normalised effective
    throughput sum_t X[j, t] r[j, t] / eq[j], where eq[j] is the job's throughput with its time split
    equally over the types it fits (so fast and slow models weigh the same). `tie_weight` adds that much of
    the total normalised throughput to the objective, so among the max-min optima it takes one that leaves
    no GPU idle. Each round (Gavel's round-based mechanism, section 5: its paper uses 6-minute rounds, here
    the simulator's round) jobs get GPU types in order of priority X[j, t] / share of its time so far spent
    on t, highest first, while the GPUs are free; a job placed where it ran keeps running (Gavel's lease
    renewal), any other pays a restart. Jobs with no share fill what is left, oldest first."""

    name = "gavel"
    every_round = True

    def __init__(
        self,
        search_s_per_gpu: float = UNPRUNED_SEARCH_S[0],
        search_max_s: float = UNPRUNED_SEARCH_S[1],
        tie_weight: float = 1e-3,
    ):
        super().__init__(search_s_per_gpu, search_max_s)
        self.tie_weight = tie_weight
        self._jobs: tuple[str, ...] = ()
        self._share: dict[str, np.ndarray] = {}  # job -> time share per GPU type
        self._received: dict[str, np.ndarray] = {}  # job -> seconds held per GPU type
        self._last: float | None = None

    def decide(self, view: View) -> dict[str, Config]:
        self._account(view)
        ids = tuple(job.id for job in view.jobs)
        if ids != self._jobs:
            self._share = self._max_min(view)
            self._jobs = ids
        return self._slice(view)

    def _account(self, view: View) -> None:
        """Credit the jobs that held GPUs since the last round with that time on their type."""
        dt = 0.0 if self._last is None else view.now - self._last
        self._last = view.now
        for job_id, (gpu_type, _) in view.current.items():
            received = self._received.setdefault(job_id, np.zeros(len(view.table.gpu_types)))
            received[view.table.gpu_types.index(gpu_type)] += dt

    def _rates(self, view: View, job: Job) -> tuple[int | None, np.ndarray]:
        """The requested count's column and the job's data-parallel samples/s on it, per GPU type."""
        dp = view.table.rates(job, dp_only=True)
        c = requested_count(job, view.table, dp)
        return c, (np.full(len(view.table.gpu_types), np.nan) if c is None else dp[:, c])

    def _max_min(self, view: View) -> dict[str, np.ndarray]:
        from scipy.optimize import linprog
        from scipy.sparse import coo_matrix

        n_types = len(view.table.gpu_types)
        var, gpus, norm = [], [], []  # (job row, type), GPUs per slot, normalised rate
        for j, job in enumerate(view.jobs):
            c, r = self._rates(view, job)
            ok = np.flatnonzero(np.isfinite(r) & (np.nan_to_num(r) > 0))
            for t in ok:
                var.append((j, int(t)))
                gpus.append(float(view.table.counts[c]))
                norm.append(float(r[t] / r[ok].mean()))
        if not var:
            return {}
        jobs_of, types_of = (np.array(col) for col in zip(*var))
        k, n_jobs, idx = len(var), len(view.jobs), np.arange(len(var))
        # rows: z - sum_t x r^ <= 0 (n_jobs), sum_t x <= 1 (n_jobs), GPUs per type <= capacity (n_types)
        rows = np.concatenate([jobs_of, n_jobs + jobs_of, 2 * n_jobs + types_of, np.unique(jobs_of)])
        cols = np.concatenate([idx, idx, idx, np.full(len(np.unique(jobs_of)), k)])
        data = np.concatenate([-np.array(norm), np.ones(k), np.array(gpus), np.ones(len(np.unique(jobs_of)))])
        a = coo_matrix((data, (rows, cols)), shape=(2 * n_jobs + n_types, k + 1)).tocsr()
        b = np.concatenate([np.zeros(n_jobs), np.ones(n_jobs), view.table.capacity.astype(float)])
        cost = np.concatenate([-self.tie_weight * np.array(norm), [-1.0]])
        res = linprog(cost, A_ub=a, b_ub=b, bounds=(0, None), method="highs")
        x = res.x if res.status == 0 else np.zeros(k + 1)
        share = {job.id: np.zeros(n_types) for job in view.jobs}
        for (j, t), value in zip(var, x[:k]):
            share[view.jobs[j].id][t] = value
        return share

    def _slice(self, view: View) -> dict[str, Config]:
        """This round's placement: (job, type) pairs by priority, each job once, while its GPUs are free."""
        free = view.table.capacity.astype(float).copy()
        order = []
        for rank, job in enumerate(view.jobs):
            c, r = self._rates(view, job)
            if c is None:
                continue
            share = self._share.get(job.id, np.zeros(len(free)))
            got = self._received.get(job.id, np.zeros(len(free))) / max(view.now - job.arrival_s, 1.0)
            for t in np.flatnonzero(np.isfinite(r)):
                priority = share[t] / got[t] if got[t] > 0 else (np.inf if share[t] > 0 else 0.0)
                order.append((-priority, rank, -share[t], int(t), job, c))
        alloc: dict[str, Config] = {}
        for _, _, _, t, job, c in sorted(order, key=lambda o: o[:4]):
            n = view.table.counts[c]
            if job.id not in alloc and free[t] >= n:
                free[t] -= n
                alloc[job.id] = (view.table.gpu_types[t], n)
        return alloc


class Sia(Policy):
    """Sia (Jayaram Subramanya et al., SOSP 2023), as its paper defines it and the Crius artifact runs it.

    - Throughput estimates are bootstrapped (section 3.2): on arrival a job is profiled on the smallest count
      that fits on each GPU type, `profile_s` per type, before Sia may allocate it; a config it has not run
      on is estimated from the same count measured on another type (scaled by the two types' profiles), or
      else linearly from its type's profile. Running on a config measures it, and the first run on a config
      the profile did not cover costs `profile_s` more (Crius artifact: DP_PROFILE_OVERHEAD_PER_CONFIG, 30 s).
    - Each round an ILP (section 3.3) picks one (GPU type, count) per job maximising the sum of
      (normalised goodput)^p plus `unallocated_penalty` per allocated job (Crius artifact sia_sched.py:
      p_fairness 0.5, not_alloc_penalty magnitude 1); normalised goodput is N_min x goodput / its smallest
      value over configs. A running job's configs other than its own are multiplied by the restart factor
      r = max((T - N S) / (T + S), 0.01) (T: time run, N: restarts so far, S: one restart's seconds).
    - Admitted jobs are never preempted (Crius artifact: "all jobs are forced to be non-preemptive"), at most
      `max_changes` running jobs change config per round (MAX_MGRT_JOB_NUM, 5), and the ILP is solved in
      partitions of `partition` jobs, oldest first (MAX_JOB_NUM_PARTITION, 200).
    - Restarts cost the restore plus the unpruned plan search, which grows with the job's GPUs.
    """

    name = "sia"
    every_round = True

    def __init__(
        self,
        search_s_per_gpu: float = UNPRUNED_SEARCH_S[0],
        search_max_s: float = UNPRUNED_SEARCH_S[1],
        *,
        p: float = 0.5,
        unallocated_penalty: float = 1.0,
        profile_s: float = 30.0,
        max_changes: int = 5,
        partition: int = 200,
        goodput_clip: float = 3000.0,
    ):
        super().__init__(search_s_per_gpu, search_max_s)
        self.p, self.unallocated_penalty, self.profile_s = p, unallocated_penalty, profile_s
        self.max_changes, self.partition, self.goodput_clip = max_changes, partition, goodput_clip
        self._measured: dict[str, set[Config]] = {}  # job -> configs it ran on (so Sia measured them)
        self._run_s: dict[str, float] = {}
        self._restarts: dict[str, int] = {}
        self._profiled: dict[tuple[str, str], int] = {}  # (job, GPU type) -> the count profiled on arrival
        self._held: dict[str, Config] = {}
        self._last: float | None = None

    def without_search_costs(self) -> Sia:
        super().without_search_costs()
        self.profile_s = 0.0
        return self

    def start_s(self, job: Job, config: Config, restart_s: float) -> float:
        """The restore and plan search of every policy, plus profiling a config Sia has not measured."""
        ran = self._measured.setdefault(job.id, set())
        unseen = config not in ran and config[1] != self._profiled.get((job.id, config[0]))
        ran.add(config)
        return super().start_s(job, config, restart_s) + (self.profile_s if unseen else 0.0)

    def decide(self, view: View) -> dict[str, Config]:
        self._account(view)
        bootstrap_s = self.profile_s * len(view.table.gpu_types)
        jobs = [job for job in view.jobs if job.id in view.current or view.now - job.arrival_s >= bootstrap_s]
        values = [self.value(view, job) for job in jobs]
        start = [view.cell(job) for job in jobs]
        held = _partitioned_ilp(
            values, start, np.asarray(view.table.counts), view.table.capacity, self.partition, self.max_changes
        )
        return _configs(view.table, held, jobs)

    def _account(self, view: View) -> None:
        """Time run and restarts per job, from what held GPUs since the last round."""
        dt = 0.0 if self._last is None else view.now - self._last
        self._last = view.now
        for job_id, config in view.current.items():
            self._run_s[job_id] = self._run_s.get(job_id, 0.0) + dt
            if job_id in self._held and self._held[job_id] != config:
                self._restarts[job_id] = self._restarts.get(job_id, 0) + 1
        self._held = dict(view.current)

    def estimate(self, view: View, job: Job) -> np.ndarray:
        """Sia's bootstrapped data-parallel samples/s per config (NaN where it does not fit memory)."""
        true = view.table.rates(job, dp_only=True)
        n = np.asarray(view.table.counts, dtype=float)
        fits = np.isfinite(true)
        first = np.where(fits.any(axis=1), fits.argmax(axis=1), 0)  # the profiled (smallest) count per type
        rows = np.arange(len(true))
        profile = np.where(fits.any(axis=1), true[rows, first], np.nan)
        est = profile[:, None] * n[None, :] / n[first][:, None]
        types, counts = view.table.gpu_types, view.table.counts
        for t in np.flatnonzero(fits.any(axis=1)):
            self._profiled[(job.id, types[t])] = counts[first[t]]
        measured = {(int(t), int(first[t])) for t in np.flatnonzero(fits.any(axis=1))}
        measured |= {(types.index(t), counts.index(k)) for t, k in self._measured.get(job.id, ())}
        for t, c in sorted(measured):
            others = np.isfinite(profile) & (rows != t)
            est[others, c] = true[t, c] * profile[others] / profile[t]
        for t, c in measured:
            est[t, c] = true[t, c]
        return np.where(fits, est, np.nan)

    def value(self, view: View, job: Job) -> np.ndarray:
        """The ILP's coefficient per config: Sia's utility of the normalised goodput it estimates, with the
        restart factor on a running job's other configs, plus the allocation term."""
        est = self.estimate(view, job)
        n = np.asarray(view.table.counts, dtype=float)
        if not np.isfinite(est).any():
            return est
        n_min = n[np.isfinite(est).any(axis=0).argmax()]
        goodput = n_min * est / np.nanmin(est)
        cell = view.cell(job)
        if cell is not None:
            s = view.restart_s + float(self.search_s(n[cell[1]]))
            t_run, restarts = self._run_s.get(job.id, 0.0), self._restarts.get(job.id, 0)
            factor = np.full_like(goodput, max((t_run - restarts * s) / (t_run + s), 0.01))
            factor[cell] = 1.0
            goodput = goodput * factor
        return np.minimum(goodput, self.goodput_clip) ** self.p + self.unallocated_penalty


def _partitioned_ilp(
    values: Sequence[np.ndarray],
    start: Sequence[Cell | None],
    counts: np.ndarray,
    capacity: np.ndarray,
    partition: int,
    max_changes: int,
) -> list[Cell | None]:
    """Sia's allocation, one ILP per `partition` jobs in order. A partition gets what earlier ones left
    minus what later ones' running jobs hold, so every running job can at least keep its config; a
    partition whose ILP fails keeps its running jobs where they are and starts nothing."""
    held: list[Cell | None] = list(start)
    free = capacity.astype(float).copy()
    for h in start:
        if h is not None:
            free[h[0]] -= counts[h[1]]
    changes = max_changes  # the round's budget of running jobs moved, spent partition by partition
    for chunk in (range(k, min(k + partition, len(values))) for k in range(0, len(values), partition)):
        room = free.copy()
        for j in chunk:
            if start[j] is not None:
                room[start[j][0]] += counts[start[j][1]]
        solved = _ilp([values[j] for j in chunk], [start[j] for j in chunk], counts, room, changes)
        if solved is not None:
            for j, h in zip(chunk, solved):
                held[j] = h
            changes -= sum(start[j] is not None and held[j] != start[j] for j in chunk)
        for j in chunk:
            if held[j] is not None:
                room[held[j][0]] -= counts[held[j][1]]
        free = room
    return held


def _ilp(
    values: Sequence[np.ndarray],
    start: Sequence[Cell | None],
    counts: np.ndarray,
    capacity: np.ndarray,
    max_changes: int,
) -> list[Cell | None] | None:
    """max sum value x  s.t. one config per running job and at most one per waiting job, GPUs per type <=
    capacity, at most `max_changes` running jobs off their config; None if HiGHS finds no solution within
    ILP_OPTIONS. Solved in two steps: the LP relaxation first (a vertex leaves only a few jobs fractional:
    about one per coupling constraint), then the ILP over those jobs with every other one fixed where the
    relaxation put it, which HiGHS closes at once; if that has no solution, the whole ILP. Not always the
    whole ILP's optimum: it can lose at most what the fractional jobs contribute, a share the relaxation
    bounds (their values are a few of hundreds), for a fraction of the whole ILP's cost (HiGHS spends most
    of that at the root finding a first solution)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    var = [
        (j, int(t), int(c))
        for j, v in enumerate(values)
        for t, c in zip(*np.nonzero((np.nan_to_num(v, nan=0.0) > 0) & (counts[None, :] <= capacity[:, None])))
    ]
    if not var:  # configs larger than what their type has left can never be chosen, so they are left out
        return [None] * len(values)
    job_of, type_of, count_of = (np.array(col) for col in zip(*var))
    idx = np.arange(len(var))
    stays = np.array([start[j] == (t, c) for j, t, c in var], dtype=float)
    running = [j for j, h in enumerate(start) if h is not None]
    a = coo_matrix(
        (
            np.concatenate([np.ones(len(var)), counts[count_of].astype(float), stays]),
            (
                np.concatenate([job_of, len(values) + type_of, np.full(len(var), len(values) + len(capacity))]),
                np.concatenate([idx, idx, idx]),
            ),
        ),
        shape=(len(values) + len(capacity) + 1, len(var)),
    )
    low = np.concatenate(
        [[1.0 if h is not None else 0.0 for h in start], np.full(len(capacity), -np.inf), [len(running) - max_changes]]
    )
    high = np.concatenate([np.ones(len(values)), capacity, [np.inf]])
    gain = np.array([values[j][t, c] for j, t, c in var])
    constraints = LinearConstraint(a.tocsr(), low, high)
    relaxed = milp(-gain, constraints=constraints, bounds=Bounds(0, 1))
    if relaxed.x is None:
        return None
    fractional = np.isin(job_of, job_of[(relaxed.x > 1e-6) & (relaxed.x < 1 - 1e-6)])
    rounded = np.round(relaxed.x)
    res = milp(
        -gain,
        constraints=constraints,
        integrality=np.ones(len(var)),
        options=dict(ILP_OPTIONS),
        bounds=Bounds(np.where(fractional, 0.0, rounded), np.where(fractional, 1.0, rounded)),
    )
    if res.x is None or res.status != 0:
        res = milp(
            -gain,
            constraints=constraints,
            integrality=np.ones(len(var)),
            bounds=Bounds(0, 1),
            options=dict(ILP_OPTIONS),
        )
    if res.x is None or res.status != 0:
        return None
    held: list[Cell | None] = [None] * len(values)
    for k in np.flatnonzero(res.x > 0.5):
        held[job_of[k]] = (int(type_of[k]), int(count_of[k]))
    return held


class Fcfs(Policy):
    """The user's GPU type and count in arrival order, no preemption; its jobs run the best plan too, so they
    pay the unpruned plan search at their start."""

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
            nodes = find_nodes(
                free[job.gpu_type], view.cluster.groups[job.gpu_type].gpus_per_node, view.table.counts[c]
            )
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
