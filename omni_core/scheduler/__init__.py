"""Cluster scheduling (Crius and baselines) and a trace-driven simulator.

cluster.py    Cluster: node groups per GPU type, free GPUs per node, packing placement, migration
jobs.py       Job, ThroughputTable (the oracle's answers over every (GPU type, power-of-two count): the best
              plan's, and the baselines' data-parallel replicas of a fixed model-parallel unit)
traces.py     Crius / ITP / Philly readers (malformed rows -> TraceIssue with file:line), seeded mapping
policies/     crius, fcfs, gavel, sia (the paper's), sia-artifact (the Crius artifact's) (`make_policy`)
simulator.py  simulate() -> SchedulePlan (per-job records, config segments, series, Metrics)
study.py      prepare(recipe) -> Study; compare(study, policies) (the estimator's CellOracle by default)
report.py     side-by-side table, figures, MLflow logging
local.py      real mode: the policies place the recipe's jobs on this machine's CPU slots and they train
              (run_schedule -> ScheduleRun), resized at checkpoints
"""

from omni_core.scheduler.cluster import Cluster, GroupSpec
from omni_core.scheduler.jobs import Job, ThroughputTable
from omni_core.scheduler.policies import POLICIES, make_policy
from omni_core.scheduler.policies.base import Policy
from omni_core.scheduler.simulator import Metrics, SchedulePlan, simulate
from omni_core.scheduler.traces import Trace, TraceIssue, load_trace

__all__ = [
    "POLICIES",
    "Cluster",
    "GroupSpec",
    "Job",
    "Metrics",
    "Policy",
    "SchedulePlan",
    "ThroughputTable",
    "Trace",
    "TraceIssue",
    "load_trace",
    "make_policy",
    "simulate",
]
