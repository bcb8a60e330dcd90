"""What every scheduling policy shares: the `View` a policy decides from, the `Policy` base class (a decision
and what a (re)start costs under the policy's system), and the helpers several policies use to turn cells of
the throughput table into configs.

Kept apart from the policies so the simulator and real mode depend on the protocol, not on any one policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from omni_core.scheduler.cluster import Cluster
from omni_core.scheduler.jobs import Config, Job, ThroughputTable

# Plan search on a config new to the job, per GPU and capped (Crius artifact macro_def.py): the baselines'
# unpruned search (RESCHED_OVERHEAD_WITHOUT_PRUNE, MAX_RESCHED_OVERHEAD_WITHOUT_PRUNE).
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
    the simulator charges that, so each policy pays for its own design, on the same oracle.

    `search_every_start`: the plan search is paid at every (re)start, as the Crius artifact's simulator charges
    it (scheduler.py:376-388 `_get_cluster_perf`, e3c8535), not only the first time a job runs on a config;
    except for a policy whose source resumes a preempted job from its checkpoint with the plan it had
    (`keeps_plans`): the artifact's charge would add a search its source never pays.

    `own_restore_s`: a (re)start's checkpoint restore as the policy's own source charges it, in place of the
    study's `restart_s` (None: the study's)."""

    name = ""
    migrates = True  # may the placement repack a fragmented group (moving jobs)?
    every_round = False  # decide every round (round-based policies), not only when a job arrives or ends
    round_s: float | None = None  # its own source's round, when it decides more often than the study's round
    keeps_plans = False  # its source resumes a job on a config it ran with that config's plan

    def __init__(
        self,
        search_s_per_gpu: float = UNPRUNED_SEARCH_S[0],
        search_max_s: float = UNPRUNED_SEARCH_S[1],
        *,
        search_every_start: bool = False,
    ):
        self.search_s_per_gpu = search_s_per_gpu
        self.search_max_s = search_max_s
        self.search_every_start = search_every_start and not self.keeps_plans
        self.own_restore_s: float | None = None
        self._ran: set[tuple[str, Config]] = set()

    def decide(self, view: View) -> dict[str, Config]:
        raise NotImplementedError

    def admits(self, job: Job, table: ThroughputTable) -> bool:
        """Whether the policy can ever give `job` a config; one it never can is counted, never queued."""
        return table.modelled(job)

    def without_search_costs(self) -> Policy:
        """The policy as real mode runs it: omni's estimator answers a plan search (or a profile) at once, and
        a launch's own restore is what it measures, so no start is charged more."""
        self.search_s_per_gpu = self.search_max_s = 0.0
        self.own_restore_s = None
        return self

    def restore_s(self, study_restart_s: float) -> float:
        """Seconds a (re)start restores its checkpoint: the policy's own source's figure, else the study's."""
        return study_restart_s if self.own_restore_s is None else self.own_restore_s

    def search_s(self, n_gpus: ArrayLike) -> np.ndarray:
        """Seconds to find the best plan on `n_gpus` GPUs of a config the job never ran on."""
        return np.minimum(self.search_s_per_gpu * np.asarray(n_gpus, dtype=float), self.search_max_s)

    def start_s(self, job: Job, config: Config, restart_s: float) -> float:
        """Seconds `job` loses starting on `config` in a study whose restore is `restart_s`: the checkpoint
        restore (`restore_s`), and the plan search the first time the job runs on that config (a found plan
        is kept), or every time."""
        new = (job.id, config) not in self._ran or self.search_every_start
        self._ran.add((job.id, config))
        return self.restore_s(restart_s) + (float(self.search_s(config[1])) if new else 0.0)


def configs_of(table: ThroughputTable, held: Sequence[Cell | None], jobs: Sequence[Job]) -> dict[str, Config]:
    """The (GPU type, count) of every job that holds a cell; jobs with none are left out (they wait)."""
    return {job.id: (table.gpu_types[h[0]], table.counts[h[1]]) for job, h in zip(jobs, held) if h is not None}


def requested_count(job: Job, table: ThroughputTable, rates: np.ndarray) -> int | None:
    """The user's GPU count (rounded up to a power of two) as a column of the table; without one, the
    smallest count where some plan fits."""
    if job.num_gpus is not None:
        want = 1 << (job.num_gpus - 1).bit_length()
        return table.counts.index(want) if want in table.counts else None
    fits = np.flatnonzero(np.isfinite(rates).any(axis=0))
    return int(fits[0]) if fits.size else None
