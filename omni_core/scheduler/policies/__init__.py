"""Scheduling policies: each looks at the active jobs at a decision and returns the configuration (GPU type,
GPU count) every job should hold next; the simulator (or real mode) places it on nodes and charges each
(re)start what the policy's system pays for it (`Policy.start_s`). This package's own module is the
registry (`POLICIES`, `make_policy`); each policy lives in a module of its own:

base.py          View (what a policy sees), Policy (decide, admits, start_s), helpers several policies share
crius.py         `crius`: greedy maximisation of cluster throughput by marginal gain, shrinking running jobs
                 so waiting ones start, response-ratio admission (the Crius paper's scheduler)
fcfs.py          `fcfs`: arrival order, the user's GPU type and count, never preempts or moves a job
gavel.py         `gavel` (Narayanan et al., OSDI 2020): heterogeneity-aware max-min fairness over effective
                 throughput, an LP over time shares realised by round-based time slicing
sia.py           `sia` (Jayaram Subramanya et al., SOSP 2023), as its paper and artifact define it: data-parallel
                 replicas of a fixed model-parallel unit, profiled on GPUs, estimates fitted to what it measured,
                 one integer program a minute
pollux.py        the throughput model Sia fits (Pollux's, as the Sia artifact's goodput.py fits it)
sia_artifact.py  `sia-artifact`: Sia as the Crius artifact runs it (plain data parallelism, event-driven)
assignment.py    the integer program both Sia variants solve

As in the Crius paper, the baselines decide with the plans their sources give them (data-parallel replicas,
never Crius's plan search); every policy's jobs run with the best plan of the chosen config (the simulator's
job: the Crius artifact's --enable_alpa), and every baseline pays for searching that plan without Crius's
Cell pruning. Crius's values are samples/s, the cluster throughput it maximises. Costs and limits are
constructor parameters; their defaults cite where they come from (the Crius artifact: github.com/sjtu-epcc/arena
at e3c8535, `macro/macro_def.py` and `baselines/`; the Sia artifact: github.com/siasosp23/artifacts at aaf7a0d).
"""

from __future__ import annotations

from omni_core.scheduler.policies.base import Policy
from omni_core.scheduler.policies.crius import Crius
from omni_core.scheduler.policies.fcfs import Fcfs
from omni_core.scheduler.policies.gavel import Gavel
from omni_core.scheduler.policies.sia import Sia
from omni_core.scheduler.policies.sia_artifact import SiaArtifact

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Crius, Fcfs, Gavel, Sia, SiaArtifact)}


def make_policy(name: str, *, search_every_start: bool = False) -> Policy:
    """A fresh `name` policy; `search_every_start` as the study charges plan searches (`Policy`)."""
    try:
        return POLICIES[name](search_every_start=search_every_start)
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (choose from {sorted(POLICIES)})") from None
