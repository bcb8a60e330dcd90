"""Sia (Jayaram Subramanya et al., SOSP 2023) as its paper and its own artifact define it: the `paper` variant,
the default (`sia`). The Crius artifact's reimplementation is the `artifact` variant (`sia_artifact.py`).

Sources: the paper (its prepublication copy in github.com/siasosp23/artifacts at aaf7a0d, sia-sosp23.pdf) and
that artifact's simulator (sia-simulator/sia.py, simulator_config.py, job.py, cluster.py, run_experiment.sh).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from omni_core.scheduler.jobs import Config, Job, ThroughputTable
from omni_core.scheduler.policies.assignment import assign
from omni_core.scheduler.policies.base import UNPRUNED_SEARCH_S, Cell, Policy, View, configs_of

Unit = tuple[int, int]  # (TP, PP) of a job's model-parallel unit on one GPU type

# Every constant below is the Sia artifact's (siasosp23/artifacts aaf7a0d) or its paper's, as cited.
ROUND_S = 60.0  # run_experiment.sh: --interval=60; paper section 5: a 60-second round for Sia
P_FAIRNESS = -0.5  # run_experiment.sh: --policy_p_val=-0.5; simulator_config.py sia_default_p_val
LAMBDA_NO_ALLOC = 1.1  # run_experiment.sh: --mip_lambda_n=1.1; simulator_config.py sia_default_lambda_n
GOODPUT_CLIP = 3000.0  # simulator_config.py sia_goodput_clip_val: the powered goodput is clipped to this
PROFILE_S = 20.0  # paper section 3.1, bootstrapping: under 20 GPU-seconds of profiling per GPU type
SCALE_UP = 2  # paper section 3.1: up by at most 2x a round; cluster.py: max_replicas = 2 x most profiled


class Sia(Policy):
    """Sia as its paper defines it, with its artifact's constants.

    - A job's model-parallel unit is fixed per GPU type (paper section 3.3, hybrid parallelism: the pipeline
      strategy fixed per GPU type, only data parallelism rescaled): the smallest TP x PP whose plain
      data-parallel replica (weights, gradients and optimizer states replicated) fits the GPU, gradient
      accumulation allowed (section 3.1, heterogeneous execution); a config is a whole number of replicas.
      A job with no unit on any type is never admitted.
    - Goodput estimates bootstrap from profiling (section 3.1): on arrival the job is profiled on one unit of
      each type (`profile_s`, the types at once) before Sia may allocate it. Until a multi-replica allocation
      has been observed, r replicas are estimated at r times the profile; a type where one has been observed
      uses its learned model (here the estimator's answer for Sia's own plan); any other type takes the
      learned type's figure scaled by the two profiles. A job grows by at most `scale_up` times the most
      replicas it has run on (cluster.py `max_replicas`, shared across types).
    - Each round (`round_s`) one integer program (section 3.3) over every job: minimise sum(G^p) over the
      chosen configs plus `lambda_no_alloc` per job left without one, G the goodput normalised to its
      smallest value (times the unit's GPUs), a running job's other configs multiplied by the restart factor
      max(T - N S, 0) / (T + S) (sia.py: 1 while T < S; T its age, N its restarts, S one restart's seconds),
      G^p rounded to 0.01 and clipped at `goodput_clip`. Jobs may be preempted (section 3: Sia is
      preemptive), except one still restoring from its last restart (sia.py: preserved allocations).
    - No profiling is charged past arrival (section 5.7: a job runs where Sia measures it); a restart costs
      the study's restore, and the unpruned plan search the first time the job runs on a config (a restored
      job keeps its plan: `keeps_plans`).
    """

    name = "sia"
    every_round = True
    round_s = ROUND_S
    keeps_plans = True  # section 3.1: jobs are checkpointed and restored, a hybrid plan fixed per GPU type

    def __init__(
        self,
        search_s_per_gpu: float = UNPRUNED_SEARCH_S[0],
        search_max_s: float = UNPRUNED_SEARCH_S[1],
        *,
        search_every_start: bool = False,
        p: float = P_FAIRNESS,
        lambda_no_alloc: float = LAMBDA_NO_ALLOC,
        goodput_clip: float = GOODPUT_CLIP,
        profile_s: float = PROFILE_S,
        scale_up: int = SCALE_UP,
    ):
        super().__init__(search_s_per_gpu, search_max_s, search_every_start=search_every_start)
        self.p, self.lambda_no_alloc, self.goodput_clip = p, lambda_no_alloc, goodput_clip
        self.profile_s, self.scale_up = profile_s, scale_up
        self._units: dict[tuple[str, int], list[Unit | None]] = {}
        self._plans: dict[tuple[str, int], _OwnPlan] = {}
        self._estimates: dict[str, tuple[int, np.ndarray]] = {}  # job -> (configs observed, its estimate)
        self._observed: dict[str, set[Config]] = {}  # job -> configs it ran on (so Sia measured them)
        self._starts: dict[str, int] = {}
        self._restoring_until: dict[str, float] = {}
        self._now = 0.0

    def without_search_costs(self) -> Sia:
        super().without_search_costs()
        self.profile_s = 0.0
        return self

    def admits(self, job: Job, table: ThroughputTable) -> bool:
        return any(unit is not None for unit in self.units(table, job))

    def start_s(self, job: Job, config: Config, restart_s: float) -> float:
        """What the study charges, remembered: the job restores until then, and has now run on `config`."""
        cost = super().start_s(job, config, restart_s)
        self._observed.setdefault(job.id, set()).add(config)
        self._starts[job.id] = self._starts.get(job.id, 0) + 1
        self._restoring_until[job.id] = self._now + cost
        return cost

    def decide(self, view: View) -> dict[str, Config]:
        self._now = view.now
        jobs = [job for job in view.jobs if view.now - job.arrival_s >= self.profile_s]
        if not jobs:
            return {}
        values = self.values(view, jobs)
        required = []
        for value, job in zip(values, jobs):
            cell = view.cell(job)
            restoring = cell is not None and view.now < self._restoring_until.get(job.id, 0.0)
            if restoring:  # keeps its config: Sia never reallocates a job in checkpoint-restore
                kept = value[cell] if np.isfinite(value[cell]) and value[cell] > 0 else 1e-9
                value[:] = np.nan
                value[cell] = kept
            required.append(restoring)
        held = assign(list(values), np.asarray(view.table.counts), view.table.capacity, required)
        if held is None:  # no solution within the solver's limits: everything stays as it is
            held = [view.cell(job) for job in jobs]
        return configs_of(view.table, held, jobs)

    def units(self, table: ThroughputTable, job: Job) -> list[Unit | None]:
        """Per GPU type, the job's model-parallel unit: the smallest TP x PP whose replica fits one unit's
        GPUs, the fastest of that size; None where none fits."""
        key = (job.model, job.global_batch)
        if key not in self._units:
            self._units[key] = [self._unit(table, job, t) for t in range(len(table.gpu_types))]
        return self._units[key]

    def _unit(self, table: ThroughputTable, job: Job, row: int) -> Unit | None:
        for c, size in enumerate(table.counts):
            shapes = [(tp, size // tp) for tp in table.counts if tp <= size]
            rates = [table.replicated(job, shape, micro_batching=True).rates[row, c] for shape in shapes]
            if np.isfinite(rates).any():
                return shapes[int(np.nanargmax(rates))]
        return None

    def own_plan(self, table: ThroughputTable, job: Job) -> _OwnPlan:
        """The job's replicas of its unit on every config, what Sia measures there, its profiles."""
        key = (job.model, job.global_batch)
        if key not in self._plans:
            units = self.units(table, job)
            counts = np.asarray(table.counts, dtype=float)
            size = np.array([np.nan if u is None else float(u[0] * u[1]) for u in units])
            replicas = counts[None, :] / size[:, None]
            rates = np.full(replicas.shape, np.nan)
            for t, unit in enumerate(units):
                if unit is not None:
                    rates[t] = table.replicated(job, unit, micro_batching=True).rates[t]
            profile = _at(rates, counts, size[:, None])[:, 0]
            whole = np.isfinite(replicas) & (replicas == np.round(replicas)) & (replicas >= 1) & np.isfinite(rates)
            self._plans[key] = _OwnPlan(size, replicas, rates, profile, whole)
        return self._plans[key]

    def estimate(self, view: View, job: Job) -> np.ndarray:
        """Sia's goodput estimate per config, samples/s (NaN where its plan does not run or it may not go);
        it changes only when the job has run on a config it had not."""
        ran = self._observed.get(job.id, set())
        cached = self._estimates.get(job.id)
        if cached is not None and cached[0] == len(ran):
            return cached[1]
        table, plan = view.table, self.own_plan(view.table, job)
        observed = [
            (table.gpu_types.index(t), table.counts.index(n))
            for t, n in ran
            if t in table.gpu_types and n in table.counts
        ]
        most = max((plan.replicas[cell] for cell in observed if np.isfinite(plan.replicas[cell])), default=0.0)
        est = plan.profile[:, None] * plan.replicas  # no multi-replica run seen yet: doubling with the replicas
        learned = sorted({t for t, c in observed if plan.replicas[t, c] > 1})
        if learned:
            source = learned[0]  # the first type with a learned model, as sia.py takes the first
            on_source = _at(
                plan.rates[source][None, :], np.asarray(table.counts, float), plan.replicas * plan.size[source]
            )
            projected = on_source * (plan.profile / plan.profile[source])[:, None]
            est = np.where(np.isfinite(projected), projected, est)
            est[learned] = plan.rates[learned]
        est = np.where(plan.whole & (plan.replicas <= max(self.scale_up * most, 1.0)), est, np.nan)
        self._estimates[job.id] = (len(ran), est)
        return est

    def values(self, view: View, jobs: list[Job]) -> np.ndarray:
        """The program's gain per job and config: `lambda_no_alloc` - G^p (the minimised objective, negated),
        with the restart factor on a running job's other configs; NaN where it may not go."""
        est = np.stack([self.estimate(view, job) for job in jobs])
        flat = np.where(np.isfinite(est), est, np.inf).reshape(len(jobs), -1)
        least = flat.argmin(axis=1)
        rows = least // est.shape[2]
        size = np.array([self.own_plan(view.table, job).size[t] for job, t in zip(jobs, rows)])
        goodput = est / flat[np.arange(len(jobs)), least][:, None, None] * size[:, None, None]
        for j, job in enumerate(jobs):
            cell = view.cell(job)
            if cell is not None:
                goodput[j] *= self._restart_factor(view, job, cell)
        with np.errstate(divide="ignore", invalid="ignore"):  # a restart factor of 0 powers to inf: clipped
            powered = np.minimum(np.round(goodput**self.p, 2), self.goodput_clip)
        return self.lambda_no_alloc - powered

    def _restart_factor(self, view: View, job: Job, cell: Cell) -> np.ndarray:
        """max(T - N S, 0) / (T + S) on every config but the job's own (1 while its age T is below S)."""
        restart = view.restart_s + float(self.search_s(view.table.counts[cell[1]]))
        age, restarts = view.now - job.arrival_s, max(self._starts.get(job.id, 1) - 1, 0)
        factor = 1.0 if age < restart else max(age - restarts * restart, 0.0) / (age + restart)
        out = np.full((len(view.table.gpu_types), len(view.table.counts)), factor)
        out[cell] = 1.0
        return out


class _OwnPlan(NamedTuple):
    """A job's own plan under Sia, per GPU type (rows) and count (columns)."""

    size: np.ndarray  # GPUs of its unit per type (NaN: none fits)
    replicas: np.ndarray  # replicas of the unit on each config
    rates: np.ndarray  # samples/s of those replicas (NaN where they do not run)
    profile: np.ndarray  # samples/s of one unit per type: what Sia profiles on arrival
    whole: np.ndarray  # configs that are a whole number of replicas, where they run


def _at(rows: np.ndarray, counts: np.ndarray, n: np.ndarray) -> np.ndarray:
    """`rows[t, c]` at the columns where `counts[c] == n[t, k]` (broadcast), NaN where `n` is no count."""
    col = np.searchsorted(counts, np.nan_to_num(n, nan=np.inf))
    safe = np.minimum(col, len(counts) - 1)
    hit = (col < len(counts)) & (counts[safe] == n)
    return np.where(
        hit, np.take_along_axis(np.broadcast_to(rows, hit.shape[:1] + rows.shape[1:]), safe, axis=1), np.nan
    )
