"""Sia as the Crius artifact runs it, the `artifact` variant (`sia-artifact`): github.com/sjtu-epcc/arena at
its final evaluation commit e3c8535, baselines/sia_sched.py, with db_querier.py's memory check and the
constants of macro/macro_def.py and resources/hardware_specs.py. The paper's Sia is `sia.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_core.estimator.oracle import ReplicaPlan
from omni_core.scheduler.jobs import Config, Job, ThroughputTable
from omni_core.scheduler.policies.assignment import assign
from omni_core.scheduler.policies.base import Cell, Policy, View

# The artifact's data-parallel jobs (sjtu-epcc/arena 65573a2, runtime/crius_worker/jax/trainer/*.py with
# is_dp_only): one Alpa stage over all GPUs, the batch on the mesh, prefer_reduce_scatter=True, which shards
# the fp32 master copy and the optimizer states over the replicas (ZeRO-style); num_micro_batches (train.py,
# default 16) accumulates gradients. dp_mem.json shows both: over 4-16 GPUs and batches 128-512 a replica of
# bert 2.6B needs 15.6 GB (6 bytes per parameter, whole) + (31.1 GB + 0.073 GB x batch) / GPUs: 31.1 GB is
# 12 bytes per parameter (the master copy and AdamW's moments, sharded), and 0.073 GB per sample is less than
# the layer outputs rematerialisation keeps of a whole sample (168 MB): micro-batches.
ALPA_DP = ReplicaPlan(micro_batching=True, sharded_states=True, micro_batches=16)


@dataclass(frozen=True)
class SiaArtifactConstants:
    """The Crius artifact's (e3c8535), each as cited."""

    p: float = 0.5  # sia_sched.py p_fairness
    goodput_clip: float = 3000.0  # sia_sched.py sia_goodput_clip_val
    admit_gain: float = 1e3  # sia_sched.py not_alloc_penalty = -1e3: the objective gains 1e3 for allocating the new job
    max_moves: int = 3  # sia_sched.py MAX_MGRT_JOB_NUM: running jobs whose config may change per admission
    restart_s: float = 600.0  # sia_sched.py: the restart factor's S, MAX_RESCHED_OVERHEAD_WITHOUT_PRUNE (macro_def.py)
    min_restart_factor: float = 0.01  # sia_sched.py: the restart factor's floor
    mem_margin: float = 1.2  # db_querier.py: a replica's needed memory x 1.2 must not exceed ...
    xla_preallocation: float = 0.8  # ... the GPU's memory x hardware_specs.py pre_alloc_memory_fraction_for_xla
    max_gpus: int = 16  # macro_def.py MAX_SUPPORTED_GPU_NUM, SUPPORTED_GPU_NUM_LIST = [1, 2, 4, 8, 16]


class SiaArtifact(Policy):
    """Sia as the Crius artifact implements it (sia_sched.py at e3c8535).

    - Data parallelism ("Sia should schedule jobs with DP"; AblationOptions(force_dp=True)) as Alpa runs it
      (`ALPA_DP`): a config is feasible when one replica's memory x `mem_margin` fits the GPU's memory x
      `xla_preallocation` (db_querier.py), at most `max_gpus` GPUs. A job with no feasible config is never
      admitted. The memory is the estimator's on the cluster's GPUs; the artifact reads its measured
      database/dp_mem.json on a 40 GB A100 (hardware_specs.py), so it refuses a slightly different set of
      jobs (docs/architecture.md).
    - Its throughput model (`_init_throughput_model`): one GPU's data-parallel samples/s times the count;
      where one GPU does not fit, the largest feasible count's samples/s over twice that count (its search
      loop doubles the count before it divides). No profiling is charged.
    - Event-driven (`schedule`): on a departure the pending jobs are retried in order, then each arrival is
      tried in arrival order; nothing moves otherwise. A try solves one integer program over every admitted
      job and the new one: each admitted job takes exactly one config, the new one at most one (gaining
      `admit_gain` if it gets one), at most `max_moves` admitted jobs off the config the last program gave
      them, GPUs per type within capacity; the utility is (G r)^p clipped at `goodput_clip`, G the goodput
      normalised to its smallest value times the fewest GPUs it runs on, r = max((T - N S) / (T + S), 0.01)
      (T its seconds run, N its (re)starts, S = `restart_s`) on all of a job's configs.
    - As `_sia_admission_control` applies a solution: the new job takes its config; an admitted job whose
      GPU type changed moves to that type at the count the previous program gave it; no admitted job's
      count changes otherwise (admitted jobs are never preempted). If that does not fit the GPUs, the
      try fails and the job waits (`_sia_resource_allocation`); the remembered solution then stays the
      last one applied, where the artifact keeps the failed try's.
    - Restarts cost what the study charges every baseline; the artifact's own is the unpruned plan search.
    """

    name = "sia-artifact"

    def __init__(self, constants: SiaArtifactConstants | None = None, **costs: Any):
        super().__init__(**costs)
        self.constants = constants or SiaArtifactConstants()
        self._estimates: dict[tuple[str, int], np.ndarray] = {}
        self._jobs: dict[str, Job] = {}  # admitted jobs
        self._solved: dict[str, Cell] = {}  # admitted job -> the config the last applied program gave it
        self._held: dict[str, Config] = {}  # admitted job -> the config it holds
        self._pending: list[Job] = []
        self._seen: set[str] = set()
        self._run_s: dict[str, float] = {}
        self._starts: dict[str, int] = {}
        self._last: float | None = None

    def admits(self, job: Job, table: ThroughputTable) -> bool:
        return bool(np.isfinite(self.estimate(table, job)).any())

    def start_s(self, job: Job, config: Config, restart_s: float) -> float:
        self._starts[job.id] = self._starts.get(job.id, 0) + 1
        return super().start_s(job, config, restart_s)

    def decide(self, view: View) -> dict[str, Config]:
        dt = 0.0 if self._last is None else view.now - self._last
        self._last = view.now
        for job_id in view.current:
            self._run_s[job_id] = self._run_s.get(job_id, 0.0) + dt
        active = {job.id for job in view.jobs}
        departed = [job_id for job_id in self._jobs if job_id not in active]
        for job_id in departed:
            del self._jobs[job_id], self._solved[job_id], self._held[job_id]
        failed: set[tuple[str, int]] = set()  # kinds refused since the last change (their try would repeat)
        if departed:
            self._pending = [job for job in self._pending if not self._try(view, job, failed)]
        for job in view.jobs:
            if job.id not in self._seen:
                self._seen.add(job.id)
                if not self._try(view, job, failed):
                    self._pending.append(job)
        return dict(self._held)

    def estimate(self, table: ThroughputTable, job: Job) -> np.ndarray:
        """The artifact's throughput model per config, samples/s; NaN where its memory check refuses."""
        key = (job.model, job.global_batch)
        if key not in self._estimates:
            replicas = table.replicated(job, ALPA_DP)
            counts = np.asarray(table.counts, dtype=float)
            k = self.constants
            fits = np.isfinite(replicas.rates) & (replicas.mem_share * k.mem_margin <= k.xla_preallocation)
            fits &= counts[None, :] <= k.max_gpus
            one_gpu = np.full(len(table.gpu_types), np.nan)
            for t in np.flatnonzero(fits.any(axis=1)):
                c = 0 if fits[t, 0] else int(np.flatnonzero(fits[t])[-1])
                one_gpu[t] = replicas.rates[t, c] / (1.0 if c == 0 else 2.0 * counts[c])
            self._estimates[key] = np.where(fits, one_gpu[:, None] * counts[None, :], np.nan)
        return self._estimates[key]

    def utility(self, view: View, job: Job) -> np.ndarray:
        """(G r)^p per config, clipped; NaN where infeasible."""
        est = self.estimate(view.table, job)
        if not np.isfinite(est).any():
            return est
        fewest = view.table.counts[int(np.flatnonzero(np.isfinite(est).any(axis=0))[0])]
        run_s, starts = self._run_s.get(job.id, 0.0), self._starts.get(job.id, 0)
        c = self.constants
        factor = max((run_s - starts * c.restart_s) / (run_s + c.restart_s), c.min_restart_factor)
        return np.minimum((fewest * est / np.nanmin(est) * factor) ** c.p, c.goodput_clip)

    def _try(self, view: View, job: Job, failed: set[tuple[str, int]]) -> bool:
        """One admission try: the program, then the solution applied if it fits; True if `job` got GPUs."""
        table, kind = view.table, (job.model, job.global_batch)
        est = self.estimate(table, job)
        free = int(table.capacity.sum()) - sum(n for _, n in self._held.values())
        fewest = min((n for n, ok in zip(table.counts, np.isfinite(est).any(axis=0)) if ok), default=None)
        if kind in failed or fewest is None or fewest > free:  # type changes keep counts: it cannot fit
            return False
        jobs = [*self._jobs.values(), job]
        values = [self.utility(view, j) for j in jobs]
        values[-1] = values[-1] + self.constants.admit_gain
        keep = [self._cell_mask(table, self._solved[j.id]) for j in jobs[:-1]]
        keep.append(np.ones((len(table.gpu_types), len(table.counts)), dtype=bool))
        held = assign(
            values,
            np.asarray(table.counts),
            table.capacity,
            [True] * (len(jobs) - 1) + [False],
            keep,
            len(jobs) - self.constants.max_moves,
        )
        applied = None if held is None or held[-1] is None else self._applied(table, jobs, held)
        if applied is None or held is None:
            failed.add(kind)
            return False
        self._held, self._jobs[job.id] = applied, job
        self._solved = {j.id: cell for j, cell in zip(jobs, held) if cell is not None}
        failed.clear()
        return True

    def _applied(self, table: ThroughputTable, jobs: list[Job], held: list[Cell | None]) -> dict[str, Config] | None:
        """The configs jobs hold once the solution is applied as the artifact applies it, or None if they do
        not fit the GPUs (or a moved job cannot run where it moved)."""
        out = dict(self._held)
        for job, cell in zip(jobs, held):
            if cell is None:
                continue
            before = self._solved.get(job.id)
            if before is None:
                out[job.id] = (table.gpu_types[cell[0]], table.counts[cell[1]])
            elif before[0] != cell[0]:
                out[job.id] = (table.gpu_types[cell[0]], table.counts[before[1]])
            if out[job.id] != self._held.get(job.id) and not np.isfinite(table.rate(job, out[job.id])):
                return None
        used = dict.fromkeys(table.gpu_types, 0)
        for gpu_type, n in out.values():
            used[gpu_type] += n
        return out if all(used[t] <= cap for t, cap in zip(table.gpu_types, table.capacity)) else None

    @staticmethod
    def _cell_mask(table: ThroughputTable, cell: Cell) -> np.ndarray:
        mask = np.zeros((len(table.gpu_types), len(table.counts)), dtype=bool)
        mask[cell] = True
        return mask
