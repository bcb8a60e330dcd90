"""Scheduling policies: each looks at the active jobs at a decision and returns the configuration (GPU type,
GPU count) every job should hold next; the simulator (or real mode) places it on nodes and charges each
(re)start what the policy's system pays for it (`Policy.start_s`). This package's own module is the
registry (`POLICIES`, `make_policy`); each policy lives in a module of its own:

base.py   View (what a policy sees), Policy (decide, start_s), helpers shared by several policies
crius.py  `crius`: greedy maximisation of cluster throughput by marginal gain, shrinking running jobs so
          waiting ones start, response-ratio admission (the Crius paper's scheduler)
fcfs.py   `fcfs`: arrival order, the user's GPU type and count, never preempts or moves a job
gavel.py  `gavel` (Narayanan et al., OSDI 2020): heterogeneity-aware max-min fairness over effective
          throughput, an LP over time shares realised by round-based time slicing
sia.py    `sia` (Jayaram Subramanya et al., SOSP 2023): an ILP per round over (GPU type, count) on
          bootstrapped throughput estimates, with its restart factor, profiling of unseen configurations and
          no preemption of admitted jobs

As in the Crius paper, the baselines decide with data-parallel throughput; every policy's jobs run with the
best plan of the chosen config (the simulator's job), and every baseline pays for searching that plan
without Crius's Cell pruning. Values are normalised throughputs (`ThroughputTable.normalised`, "effective
GPUs"), so jobs of different models add up fairly. Costs and limits are constructor parameters; their
defaults cite where they come from (the Crius artifact: github.com/sjtu-epcc/arena, branch ae-eurosys,
`macro/macro_def.py` and `baselines/sia_sched.py`).
"""

from __future__ import annotations

from omni_core.scheduler.policies.base import Policy
from omni_core.scheduler.policies.crius import Crius
from omni_core.scheduler.policies.fcfs import Fcfs
from omni_core.scheduler.policies.gavel import Gavel
from omni_core.scheduler.policies.sia import Sia

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Crius, Fcfs, Gavel, Sia)}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (choose from {sorted(POLICIES)})") from None
