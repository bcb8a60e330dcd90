"""Sia (Jayaram Subramanya et al., SOSP 2023) as its paper and its own artifact define it: the `paper` variant,
the default (`sia`). The Crius artifact's reimplementation is the `artifact` variant (`sia_artifact.py`).

Sources: the paper (its prepublication copy in github.com/siasosp23/artifacts at aaf7a0d, sia-sosp23.pdf) and
that artifact's simulator (sia-simulator/sia.py, simulator_config.py, job.py, cluster.py, goodput.py,
applications.py, run_experiment.sh).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from omni_core.estimator.oracle import ReplicaPlan
from omni_core.scheduler.jobs import Config, Job, ThroughputTable
from omni_core.scheduler.policies import pollux
from omni_core.scheduler.policies.assignment import assign
from omni_core.scheduler.policies.base import Cell, Policy, View, configs_of

Unit = tuple[int, int]  # (TP, PP) of a job's model-parallel unit on one GPU type


@dataclass(frozen=True)
class SiaConstants:
    """Every constant is the Sia artifact's (siasosp23/artifacts aaf7a0d) or its paper's, as cited."""

    p: float = -0.5  # run_experiment.sh --policy_p_val=-0.5; simulator_config.py sia_default_p_val
    lambda_no_alloc: float = 1.1  # run_experiment.sh --mip_lambda_n=1.1; simulator_config.py sia_default_lambda_n
    goodput_clip: float = 3000.0  # simulator_config.py sia_goodput_clip_val: the powered goodput is clipped to this
    profile_s: float = 20.0  # paper section 3.1, bootstrapping: under 20 GPU-seconds of profiling per GPU type
    scale_up: int = 2  # paper section 3.1: up by at most 2x a round; cluster.py: max_replicas = 2 x most profiled
    # A (re)start's checkpoint-restore seconds, charged in place of the study's restore (None: the study's):
    # job.py reallocate/migrate `rescale_time = app.rescale_time or 30`, applications.py's 30 s for a model it did
    # not measure, the same 30 s sia.py get_restart_penalty puts in the restart factor.
    restart_s: float | None = 30.0


class Sia(Policy):
    """Sia as its paper defines it, with its artifact's constants (`SiaConstants`).

    - A job's model-parallel unit is fixed per GPU type (paper section 3.3, hybrid parallelism: the pipeline
      strategy fixed per GPU type, only data parallelism rescaled): the smallest TP x PP whose plain
      data-parallel replica (weights, gradients and optimizer states replicated) fits the GPU, gradient
      accumulation allowed (section 3.1, heterogeneous execution); a config is a whole number of replicas.
      A job with no unit on any type is never admitted.
    - Profiling (section 3.1): one unit of each type runs the job at batch sizes 1, 2, 4, ... up to the memory
      limit (or its batch), `profile_s` seconds on real GPUs: from its arrival on GPUs the last minute left
      idle, else at the next decision on GPUs held back from the program for that minute's share; the job is
      allocated only once its profile is done.
    - Goodput estimates (section 3.1, bootstrapping): per type, Pollux's throughput model (`pollux.py`) fitted
      to what Sia measured there, its profile and the configs the job ran on (its own plan's step and
      sync seconds). Until a multi-replica run has been observed anywhere, r replicas are estimated at r
      times the one-unit figure; a type where one has been observed uses its fitted model; any other type
      takes the first such type's model scaled by the two one-unit figures. A job starts on one unit; then a
      job that declares its GPU count (the trace's request: fixed batch, Sia's strong-scaling job) takes up
      to that count, any other grows by at most `scale_up` times the most replicas it has run on (cluster.py
      `max_replicas`, shared across types).
    - Each minute one integer program (section 3.3) over every profiled job: minimise sum(G^p) over the
      chosen configs plus `lambda_no_alloc` per job left without one, G the goodput normalised to its
      smallest value (times the unit's GPUs), a running job's other configs multiplied by the restart factor
      max(T - N S, 0) / (T + S) (sia.py: 1 while T < S; T its age, N its restarts, S one restart's seconds),
      G^p rounded to 0.01 and clipped at `goodput_clip`. Jobs may be preempted (section 3: Sia is
      preemptive), except one still restoring from its last restart (sia.py: preserved allocations).
    - A (re)start costs `restart_s` (Sia's simulator's restore), and the unpruned plan search the first time
      the job runs on a config (a restored job keeps its plan: `keeps_plans`).
    """

    name = "sia"
    every_round = True
    round_s = 60.0  # run_experiment.sh: --interval=60; paper section 5: a 60-second round for Sia
    keeps_plans = True  # section 3.1: jobs are checkpointed and restored, a hybrid plan fixed per GPU type

    def __init__(self, constants: SiaConstants | None = None, **costs: Any):
        super().__init__(**costs)
        self.constants = constants or SiaConstants()
        self.own_restore_s = self.constants.restart_s
        self._units: dict[tuple[str, int], list[Unit | None]] = {}
        self._plans: dict[tuple[str, int], _OwnPlan] = {}
        self._fits: dict[tuple[str, int, int, tuple[int, ...]], pollux.PerfParams] = {}
        self._estimates: dict[str, tuple[int, np.ndarray]] = {}  # job -> (configs observed, its estimate)
        self._observed: dict[str, set[Config]] = {}  # job -> configs it ran on (so Sia measured them)
        self._profiled: dict[str, float] = {}  # job -> when its profile is done
        self._starts: dict[str, int] = {}
        self._restoring_until: dict[str, float] = {}
        self._per_node: dict[str, int] = {}
        self._now = 0.0

    def without_search_costs(self) -> Sia:
        super().without_search_costs()
        self.constants = replace(self.constants, profile_s=0.0, restart_s=None)
        return self

    def admits(self, job: Job, table: ThroughputTable) -> bool:
        return bool(np.isfinite(self.own_plan(table, job).size).any())

    def start_s(self, job: Job, config: Config, restart_s: float) -> float:
        """What Sia's system pays, remembered: the job restores until then, and has now run on `config`."""
        cost = super().start_s(job, config, restart_s)
        self._observed.setdefault(job.id, set()).add(config)
        self._starts[job.id] = self._starts.get(job.id, 0) + 1
        self._restoring_until[job.id] = self._now + cost
        return cost

    def decide(self, view: View) -> dict[str, Config]:
        self._now = view.now
        self._per_node = {t: g.gpus_per_node for t, g in view.cluster.groups.items()}
        restoring = {
            job.id for job in view.jobs if job.id in view.current and view.now < self._restoring_until.get(job.id, 0.0)
        }
        reserved = self._profile(view, _gpus(view, restoring))
        jobs = [job for job in view.jobs if self._profiled.get(job.id, math.inf) <= view.now]
        if not jobs:
            return {}
        values = self.values(view, jobs)
        for value, job in zip(values, jobs):
            cell = view.cell(job)
            if job.id in restoring and cell is not None:  # keeps its config: never reallocated mid-restore
                kept = value[cell] if np.isfinite(value[cell]) and value[cell] > 0 else 1e-9
                value[:] = np.nan
                value[cell] = kept
        required = [job.id in restoring for job in jobs]
        capacity = view.table.capacity - reserved
        held = assign(list(values), np.asarray(view.table.counts), capacity, required)
        if held is None:  # no solution within the solver's limits: everything stays as it is
            held = [view.cell(job) for job in jobs]
        return configs_of(view.table, held, jobs)

    def _profile(self, view: View, restoring: np.ndarray) -> np.ndarray:
        """Profile the jobs not yet profiled, in arrival order; the GPUs per type held back for profiles in the
        coming minute. A profile's part before now ran on GPUs the last minute left idle, if there were
        enough; the rest runs in the coming minute, on GPUs not restoring, or waits for the next decision."""
        table, step, profile_s = view.table, self.round_s, self.constants.profile_s
        idle_s = (table.capacity - _gpus(view, set(view.current))) * step
        reserve_s = np.zeros(len(table.gpu_types))
        for job in view.jobs:
            if job.id in self._profiled:
                continue
            size = np.nan_to_num(self.own_plan(table, job).size)
            before = min(view.now - job.arrival_s, profile_s)
            after = profile_s
            if (size * before <= idle_s).all():
                idle_s = idle_s - size * before
                after -= before
            if after > 0 and (np.ceil((reserve_s + size * after) / step) > table.capacity - restoring).any():
                continue  # no unit of some type free: it profiles later
            reserve_s += size * after
            self._profiled[job.id] = view.now + after
        return np.ceil(reserve_s / step)

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
            rates = [table.replicated(job, ReplicaPlan(shape, True)).rates[row, c] for shape in shapes]
            if np.isfinite(rates).any():
                return shapes[int(np.nanargmax(rates))]
        return None

    def own_plan(self, table: ThroughputTable, job: Job) -> _OwnPlan:
        """The job's replicas of its unit on every config, their samples/s, and its profile per type."""
        key = (job.model, job.global_batch)
        if key not in self._plans:
            units = self.units(table, job)
            counts = np.asarray(table.counts, dtype=float)
            size = np.array([np.nan if u is None else float(u[0] * u[1]) for u in units])
            rates = np.full((len(units), len(counts)), np.nan)
            profiles: list[list[pollux.Observation]] = []
            for t, unit in enumerate(units):
                profiles.append([] if unit is None else self._profile_runs(table, job, t, unit))
                if unit is not None and profiles[t]:
                    rates[t] = table.replicated(job, ReplicaPlan(unit, True)).rates[t]
                else:  # a unit it cannot profile (no batch fits in one micro-batch) is none to Sia
                    size[t] = np.nan
            replicas = counts[None, :] / size[:, None]
            whole = np.isfinite(replicas) & (replicas == np.round(replicas)) & (replicas >= 1) & np.isfinite(rates)
            atomic = np.array([max((o.atomic_bsz for o in runs), default=np.nan) for runs in profiles])
            self._plans[key] = _OwnPlan(size, replicas, rates, whole, profiles, atomic)
        return self._plans[key]

    def _profile_runs(self, table: ThroughputTable, job: Job, row: int, unit: Unit) -> list[pollux.Observation]:
        """One unit of type `row` at batch sizes 1, 2, 4, ... while they fit (at most the job's batch)."""
        runs = []
        batch = 1
        while batch <= job.global_batch:
            step = self._unit_step_s(table, job, row, unit, batch)
            if not np.isfinite(step):
                break
            runs.append(pollux.Observation(1, 1, batch, step, step))
            batch *= 2
        return runs

    def _unit_step_s(self, table: ThroughputTable, job: Job, row: int, unit: Unit, batch: int) -> float:
        """Seconds of one step of one unit at `batch`, in one micro-batch (inf where it does not fit)."""
        est = table.oracle.replicated(job.model, batch, table.gpu_types[row], unit[0] * unit[1], ReplicaPlan(unit))
        return batch / est.samples_per_s if est is not None and est.samples_per_s > 0 else math.inf

    def _fitted(self, table: ThroughputTable, job: Job, row: int, ran: list[int]) -> pollux.PerfParams:
        """Pollux's model of type `row`, fitted to its profile and the counts (columns) `ran` there."""
        key = (job.model, job.global_batch, row, tuple(sorted(ran)))
        if key not in self._fits:
            plan, unit = self.own_plan(table, job), self.units(table, job)[row]
            assert unit is not None
            runs = list(plan.profiles[row])
            for c in ran:
                r = int(plan.replicas[row, c])
                steps = math.ceil(job.global_batch / r / plan.atomic[row] - 1e-8)  # accumulation micro-steps + 1
                atomic = math.ceil(job.global_batch / r / steps - 1e-8)
                accum = self._unit_step_s(table, job, row, unit, atomic)
                optim = max(job.global_batch / plan.rates[row, c] - (steps - 1) * accum, accum)
                runs.append(pollux.Observation(self._nodes(table, plan, row, r), r, atomic, accum, optim))
            self._fits[key] = pollux.fit(runs)
        return self._fits[key]

    @staticmethod
    def _configs(table: ThroughputTable) -> set[Config]:
        return {(t, n) for t in table.gpu_types for n in table.counts}

    def _nodes(self, table: ThroughputTable, plan: _OwnPlan, row: int, replicas: Any) -> Any:
        """Nodes the replicas' gradient exchange spans on type `row` (1 for a single replica)."""
        per_node = self._per_node.get(table.gpu_types[row], 1)
        return np.where(np.asarray(replicas) > 1, np.ceil(np.asarray(replicas) * plan.size[row] / per_node), 1.0)

    def _predicted(self, table: ThroughputTable, job: Job, row: int, ran: list[int], replicas: Any) -> np.ndarray:
        plan = self.own_plan(table, job)
        params = self._fitted(table, job, row, ran)
        r = np.asarray(replicas, dtype=float)
        return pollux.samples_per_s(params, job.global_batch, plan.atomic[row], self._nodes(table, plan, row, r), r)

    def estimate(self, view: View, job: Job) -> np.ndarray:
        """Sia's goodput estimate per config, samples/s (NaN where its plan does not run or it may not go);
        it changes only when the job has run on a config it had not."""
        ran = self._observed.get(job.id, set())
        cached = self._estimates.get(job.id)
        if cached is not None and cached[0] == len(ran):
            return cached[1]
        table, plan = view.table, self.own_plan(view.table, job)
        cells = [(table.gpu_types.index(t), table.counts.index(n)) for t, n in ran if (t, n) in self._configs(table)]
        observed = [cell for cell in cells if plan.whole[cell]]
        on = {t: [c for s, c in observed if s == t] for t in range(len(table.gpu_types))}
        units = [t for t in range(len(table.gpu_types)) if np.isfinite(plan.size[t])]
        one = np.full(len(table.gpu_types), np.nan)
        for t in units:
            one[t] = self._predicted(table, job, t, on[t], 1)[()]
        est = one[:, None] * plan.replicas  # no multi-replica run seen yet: doubling with the replicas
        learned = sorted({t for t, c in observed if plan.replicas[t, c] > 1})
        if learned:
            source = learned[0]  # the first type with a learned model, as sia.py takes the first
            for t in units:
                est[t] = self._predicted(table, job, source, on[source], plan.replicas[t]) * one[t] / one[source]
            for t in learned:
                est[t] = self._predicted(table, job, t, on[t], plan.replicas[t])
        est = np.where(plan.whole & (plan.replicas <= self._most_replicas(job, plan, observed)), est, np.nan)
        self._estimates[job.id] = (len(ran), est)
        return est

    def _most_replicas(self, job: Job, plan: _OwnPlan, observed: list[Cell]) -> np.ndarray | float:
        """How many replicas the job may take per type. Before its first run, one (its unit alone). A job
        with a fixed batch that declares its GPUs (a strong-scaling job, paper section 3.1: the user declares
        max_ngpus) up to that many, at least one unit (cluster.py get_sia_multi_job_info: a "scale-gpus"
        job's max_replicas is its target_num_replicas); any other `scale_up` times the most it has run on."""
        most = max((plan.replicas[cell] for cell in observed), default=0.0)
        if not most:
            return 1.0
        if job.num_gpus is None:
            return self.constants.scale_up * most
        declared = 1 << (job.num_gpus.bit_length() - 1)  # sia.py: the configs of at most that many GPUs
        return np.maximum(np.floor(declared / plan.size), 1.0)[:, None]

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
            powered = np.minimum(np.round(goodput**self.constants.p, 2), self.constants.goodput_clip)
        return self.constants.lambda_no_alloc - powered

    def _restart_factor(self, view: View, job: Job, cell: Cell) -> np.ndarray:
        """max(T - N S, 0) / (T + S) on every config but the job's own (1 while its age T is below S)."""
        restart = self.restore_s(view.restart_s) + float(self.search_s(view.table.counts[cell[1]]))
        age, restarts = view.now - job.arrival_s, max(self._starts.get(job.id, 1) - 1, 0)
        factor = 1.0 if age < restart else max(age - restarts * restart, 0.0) / (age + restart)
        out = np.full((len(view.table.gpu_types), len(view.table.counts)), factor)
        out[cell] = 1.0
        return out


class _OwnPlan(NamedTuple):
    """A job's own plan under Sia, per GPU type (rows) and count (columns)."""

    size: np.ndarray  # GPUs of its unit per type (NaN: none fits)
    replicas: np.ndarray  # replicas of the unit on each config
    rates: np.ndarray  # samples/s of those replicas (NaN where they do not run): what Sia measures running there
    whole: np.ndarray  # configs that are a whole number of replicas, where they run
    profiles: list[list[pollux.Observation]]  # per type, what profiling one unit measured
    atomic: np.ndarray  # per type, the largest batch one unit ran in one micro-batch when profiled


def _gpus(view: View, jobs: set[str]) -> np.ndarray:
    """GPUs per type that `jobs` hold now."""
    out = np.zeros(len(view.table.gpu_types))
    for job_id in jobs:
        gpu_type, n = view.current[job_id]
        out[view.table.gpu_types.index(gpu_type)] += n
    return out
