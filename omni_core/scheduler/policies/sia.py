"""Sia (Jayaram Subramanya et al., SOSP 2023): an ILP per round over (GPU type, count) on bootstrapped
throughput estimates, with its restart factor, profiling of unseen configurations and no preemption of
admitted jobs. A baseline for Crius; the ILP it solves each round is here too, as only Sia uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from omni_core.scheduler.jobs import Config, Job
from omni_core.scheduler.policies.base import UNPRUNED_SEARCH_S, Cell, Policy, View, configs_of

if TYPE_CHECKING:
    from scipy.optimize import LinearConstraint

# Sia's ILP solve: branch-and-bound nodes, not seconds (a time limit would make runs depend on load).
ILP_OPTIONS = {"node_limit": 2000}

Var = tuple[int, int, int]  # an ILP variable: (job, row in table.gpu_types, column in table.counts)


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
        return configs_of(view.table, held, jobs)

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
        for row in np.flatnonzero(fits.any(axis=1)):
            self._profiled[(job.id, types[row])] = counts[first[row]]
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
            h = start[j]
            if h is not None:
                room[h[0]] += counts[h[1]]
        solved = _ilp([values[j] for j in chunk], [start[j] for j in chunk], counts, room, changes)
        if solved is not None:
            for j, h in zip(chunk, solved):
                held[j] = h
            changes -= sum(start[j] is not None and held[j] != start[j] for j in chunk)
        for j in chunk:
            h = held[j]
            if h is not None:
                room[h[0]] -= counts[h[1]]
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
    ILP_OPTIONS (see `_solve_binary` for how)."""
    var = _ilp_variables(values, counts, capacity)
    if not var:  # configs larger than what their type has left can never be chosen, so they are left out
        return [None] * len(values)
    job_of, type_of, count_of = (np.array(col) for col in zip(*var))
    gain = np.array([values[j][t, c] for j, t, c in var])
    x = _solve_binary(gain, _ilp_constraints(var, start, counts, capacity, max_changes), job_of)
    if x is None:
        return None
    held: list[Cell | None] = [None] * len(values)
    for k in np.flatnonzero(x > 0.5):
        held[job_of[k]] = (int(type_of[k]), int(count_of[k]))
    return held


def _ilp_variables(values: Sequence[np.ndarray], counts: np.ndarray, capacity: np.ndarray) -> list[Var]:
    """The configs each job may be given: worth something to it and no larger than what its type has."""
    return [
        (j, int(t), int(c))
        for j, v in enumerate(values)
        for t, c in zip(*np.nonzero((np.nan_to_num(v, nan=0.0) > 0) & (counts[None, :] <= capacity[:, None])))
    ]


def _ilp_constraints(
    var: Sequence[Var], start: Sequence[Cell | None], counts: np.ndarray, capacity: np.ndarray, max_changes: int
) -> LinearConstraint:
    """Rows, in order: configs per job (exactly one for a running job, at most one for a waiting one), GPUs
    per type (at most the capacity), and running jobs that keep their config (all but `max_changes`)."""
    from scipy.optimize import LinearConstraint
    from scipy.sparse import coo_matrix

    n_jobs = len(start)
    job_of, type_of, count_of = (np.array(col) for col in zip(*var))
    idx = np.arange(len(var))
    stays = np.array([start[j] == (t, c) for j, t, c in var], dtype=float)
    running = [j for j, h in enumerate(start) if h is not None]
    a = coo_matrix(
        (
            np.concatenate([np.ones(len(var)), counts[count_of].astype(float), stays]),
            (
                np.concatenate([job_of, n_jobs + type_of, np.full(len(var), n_jobs + len(capacity))]),
                np.concatenate([idx, idx, idx]),
            ),
        ),
        shape=(n_jobs + len(capacity) + 1, len(var)),
    )
    low = np.concatenate(
        [[1.0 if h is not None else 0.0 for h in start], np.full(len(capacity), -np.inf), [len(running) - max_changes]]
    )
    high = np.concatenate([np.ones(n_jobs), capacity, [np.inf]])
    return LinearConstraint(a.tocsr(), low, high)


def _solve_binary(gain: np.ndarray, constraints: LinearConstraint, job_of: np.ndarray) -> np.ndarray | None:
    """The 0/1 x maximising gain x under `constraints`, or None if HiGHS finds none within ILP_OPTIONS.

    Solved in two steps: the LP relaxation first (a vertex leaves only a few jobs fractional: about one per
    coupling constraint), then the ILP over those jobs with every other one fixed where the relaxation put
    it, which HiGHS closes at once; if that has no solution, the whole ILP. Not always the whole ILP's
    optimum: it can lose at most what the fractional jobs contribute, a share the relaxation bounds (their
    values are a few of hundreds), for a fraction of the whole ILP's cost (HiGHS spends most of that at the
    root finding a first solution)."""
    from scipy.optimize import Bounds, milp

    relaxed = milp(-gain, constraints=constraints, bounds=Bounds(0, 1))
    if relaxed.x is None:
        return None
    fractional = np.isin(job_of, job_of[(relaxed.x > 1e-6) & (relaxed.x < 1 - 1e-6)])
    rounded = np.round(relaxed.x)
    res = milp(
        -gain,
        constraints=constraints,
        integrality=np.ones(len(gain)),
        options=dict(ILP_OPTIONS),
        bounds=Bounds(np.where(fractional, 0.0, rounded), np.where(fractional, 1.0, rounded)),
    )
    if res.x is None or res.status != 0:
        res = milp(
            -gain,
            constraints=constraints,
            integrality=np.ones(len(gain)),
            bounds=Bounds(0, 1),
            options=dict(ILP_OPTIONS),
        )
    if res.x is None or res.status != 0:
        return None
    return res.x
