"""The 0/1 assignment both Sia variants solve: at most one (GPU type, count) per job, GPUs per type within
capacity, optionally most jobs kept where they are. Sia's own code solves it with GLPK through CVXPY (Sia
artifact sia.py, Crius artifact sia_sched.py); here SciPy's HiGHS, the same integer program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from omni_core.scheduler.policies.base import Cell

if TYPE_CHECKING:
    from scipy.optimize import LinearConstraint

# branch-and-bound nodes, not seconds (a time limit would make runs depend on the machine's load)
ILP_OPTIONS = {"node_limit": 2000}


def assign(
    values: Sequence[np.ndarray],
    counts: np.ndarray,
    capacity: np.ndarray,
    required: Sequence[bool],
    keep: Sequence[np.ndarray | None] = (),
    min_kept: int = 0,
) -> list[Cell | None] | None:
    """max sum of `values[j][t, c]` over the chosen cells, where a job may take only cells worth more than 0.

    `required[j]`: job j takes exactly one cell, else at most one. `keep[j]` (a boolean mask of cells, or None)
    marks the cells that count as keeping job j where it was; at least `min_kept` jobs must take such a cell.
    GPUs of each type taken are at most `capacity`. None if HiGHS finds no solution within ILP_OPTIONS."""
    if not len(values):
        return []
    stacked = np.nan_to_num(np.stack(values), nan=0.0)
    job_of, type_of, count_of = np.nonzero((stacked > 0) & (counts[None, :] <= capacity[:, None])[None])
    if not job_of.size:
        return None if any(required) else [None] * len(values)
    gain = stacked[job_of, type_of, count_of]
    kept = None
    if keep:
        masks = np.stack([np.zeros(stacked.shape[1:], bool) if mask is None else mask for mask in keep])
        kept = masks[job_of, type_of, count_of]
    x = _solve_binary(
        gain, _constraints((job_of, type_of, count_of), counts, capacity, required, kept, min_kept), job_of
    )
    if x is None:
        return None
    held: list[Cell | None] = [None] * len(values)
    for k in np.flatnonzero(x > 0.5):
        held[job_of[k]] = (int(type_of[k]), int(count_of[k]))
    return held


def _constraints(
    var: tuple[np.ndarray, np.ndarray, np.ndarray],
    counts: np.ndarray,
    capacity: np.ndarray,
    required: Sequence[bool],
    kept: np.ndarray | None,
    min_kept: int,
) -> LinearConstraint:
    """Rows, in order: cells per job (exactly one where required, else at most one), GPUs per type (at most
    the capacity), and, with `kept`, jobs kept where they were (at least `min_kept`)."""
    from scipy.optimize import LinearConstraint
    from scipy.sparse import coo_matrix

    n_jobs = len(required)
    job_of, type_of, count_of = var
    idx = np.arange(len(job_of))
    data = [np.ones(len(job_of)), counts[count_of].astype(float)]
    rows = [job_of, n_jobs + type_of]
    low = [np.array([1.0 if r else 0.0 for r in required]), np.full(len(capacity), -np.inf)]
    high = [np.ones(n_jobs), capacity.astype(float)]
    if kept is not None:
        data.append(kept.astype(float))
        rows.append(np.full(len(job_of), n_jobs + len(capacity)))
        low.append(np.array([float(min_kept)]))
        high.append(np.array([np.inf]))
    a = coo_matrix(
        (np.concatenate(data), (np.concatenate(rows), np.concatenate([idx] * len(rows)))),
        shape=(n_jobs + len(capacity) + (kept is not None), len(job_of)),
    )
    return LinearConstraint(a.tocsr(), np.concatenate(low), np.concatenate(high))


def _solve_binary(gain: np.ndarray, constraints: LinearConstraint, job_of: np.ndarray) -> np.ndarray | None:
    """The 0/1 x maximising gain x under `constraints`, or None if HiGHS finds none within ILP_OPTIONS.

    Solved in two steps: the LP relaxation first (a vertex leaves only a few jobs fractional: about one per
    coupling constraint, often none, and then it is the answer), then the ILP over those jobs with every other
    one fixed where the relaxation put it, which HiGHS closes at once; if that has no solution, the whole ILP.
    Not always the whole ILP's optimum: it can lose at most what the fractional jobs contribute, a share the
    relaxation bounds, for a fraction of the whole ILP's cost (HiGHS spends most of that at the root finding a
    first solution)."""
    from scipy.optimize import Bounds, milp

    relaxed = milp(-gain, constraints=constraints, bounds=Bounds(0, 1))
    if relaxed.x is None:
        return None
    split = (relaxed.x > 1e-6) & (relaxed.x < 1 - 1e-6)
    if not split.any():  # an integral optimum of the relaxation is the program's optimum
        return np.round(relaxed.x)
    fractional = np.isin(job_of, job_of[split])
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
