"""The throughput model Sia's goodput estimator fits to what it has observed of a job: Pollux's (Qiao et al.,
OSDI 2021), as the Sia artifact's simulator carries it (github.com/siasosp23/artifacts at aaf7a0d,
sia-simulator/goodput.py). Per GPU type, a step of `replicas` data-parallel replicas on `nodes` nodes is

    accum_steps x T_acc + (T_acc^gamma + T_net^gamma)^(1 / gamma),   T_acc = alpha_c + beta_c x atomic batch,

T_net = alpha_n + beta_n x (replicas - 2) across nodes, alpha_r + beta_r x (replicas - 2) within one node, ~0
for one replica. The fit (`fit`, goodput.py fit_perf_params) minimises the RMS log error of the accumulation
and optimiser step times, with its priors: parameters no observation can inform are held at their bounds.
Sia's jobs here keep their batch (no batch-size tuning), so its goodput is this throughput.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from scipy.optimize import minimize

TINY = 1e-8  # goodput.py: the parameters' lower bound, and the network time of a single replica
GAMMA_MAX = 10.0  # goodput.py: gamma in [1, 10]


class PerfParams(NamedTuple):
    """goodput.py PerfParams, in its order."""

    alpha_c: float
    beta_c: float
    alpha_n: float
    beta_n: float
    alpha_r: float
    beta_r: float
    gamma: float


class Observation(NamedTuple):
    """One measured configuration (goodput.py's profile entry): nodes, replicas and atomic (micro-)batch, the
    seconds of one accumulation micro-step (compute only) and of the optimiser step (compute and sync)."""

    nodes: int
    replicas: int
    atomic_bsz: float
    accum_s: float
    optim_s: float


def network_seconds(params: np.ndarray, nodes: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    """goodput.py _predict_network_time: the bottleneck link's constant plus its retrogression term."""
    conds = [nodes > 1, replicas > 1]
    bottleneck = np.select(conds, [params[2], params[4]], TINY)
    retrogress = np.select(conds, [params[3], params[5]], TINY)
    return bottleneck + retrogress * np.maximum(replicas - 2, TINY)


def optim_seconds(params: np.ndarray, accum: np.ndarray, network: np.ndarray) -> np.ndarray:
    """goodput.py _predict_log_optim_time, exponentiated: compute and network overlapped as a gamma-norm."""
    gamma = params[6]
    return np.exp(np.log(accum**gamma + network**gamma) / gamma)


def _objective(free: np.ndarray, fixed: np.ndarray, mask: np.ndarray, obs: np.ndarray) -> tuple[float, np.ndarray]:
    """goodput.py _obj_fn and its gradient (the artifact differentiates it with autograd): RMS log errors of
    both step times, plus its two regularisers."""
    p = fixed.copy()
    p[mask] = free
    nodes, replicas, atomic, accum_obs, optim_obs = obs
    inter, intra = nodes > 1, (nodes <= 1) & (replicas > 1)
    spread = np.maximum(replicas - 2, TINY)
    accum = p[0] + p[1] * atomic
    net = network_seconds(p, nodes, replicas)
    total = accum ** p[6] + net ** p[6]
    log_optim = np.log(total) / p[6]
    d1, d2 = np.log(accum) - np.log(accum_obs), log_optim - np.log(optim_obs)
    err1, err2 = math.sqrt(np.mean(d1**2)), math.sqrt(np.mean(d2**2))
    d_accum = np.stack([np.ones_like(atomic), atomic])  # d accum / d (alpha_c, beta_c)
    d_net = np.stack([inter, inter * spread, intra, intra * spread]).astype(float)  # d net / d (alpha_n .. beta_r)
    by_accum, by_net = accum ** (p[6] - 1) / total, net ** (p[6] - 1) / total
    by_gamma = (accum ** p[6] * np.log(accum) + net ** p[6] * np.log(net)) / (p[6] * total) - log_optim / p[6]
    d_log_optim = np.concatenate([d_accum * by_accum, d_net * by_net, by_gamma[None]])
    d_log_accum = np.concatenate([d_accum / accum, np.zeros((5, len(atomic)))])
    grad = np.zeros(7)
    if err1 > 0:
        grad += (d_log_accum @ d1) / len(d1) / err1
    if err2 > 0:
        grad += (d_log_optim @ d2) / len(d2) / err2
    grad[6] += 2e-3 * (p[6] - 1)
    grad[[3, 5]] += 2e-2 * p[[3, 5]] / p[[2, 4]] ** 2
    grad[[2, 4]] -= 2e-2 * p[[3, 5]] ** 2 / p[[2, 4]] ** 3
    reg = 1e-3 * (p[6] - 1) ** 2 + 1e-2 * ((p[3] / p[2]) ** 2 + (p[5] / p[4]) ** 2)
    return float(err1 + err2 + reg), grad[mask]


def fit(observations: Sequence[Observation]) -> PerfParams:
    """goodput.py fit_perf_params: its start, bounds and the priors that hold parameters no observation informs."""
    obs = np.array(observations, dtype=float).T
    nodes, replicas, atomic, accum, _ = obs
    start = np.array([1e-1, 1e-2] * 3 + [1.0 + 1e-3])
    lower = np.array([TINY, TINY] * 3 + [1.0])
    upper = np.array([np.inf, np.inf] * 3 + [GAMMA_MAX])
    held = np.zeros(7, dtype=bool)
    if len(np.unique(atomic)) == 1:  # one atomic batch: alpha_c fixed at half the accumulation time
        start[0] = lower[0] = upper[0] = np.mean(accum) / 2
        held[0] = True
    if not np.any(nodes > 1):  # no multi-node observation: alpha_n, beta_n at their bounds
        held[[2, 3]] = True
    if not np.any((nodes == 1) & (replicas > 1)):  # no single-node multi-replica one: alpha_r, beta_r too
        held[[4, 5]] = True
    if not np.any(replicas > 2):  # nothing beyond two replicas: no retrogression
        held[[3, 5]] = True
    start[held & (np.arange(7) > 0)] = lower[held & (np.arange(7) > 0)]
    mask = ~held
    result = minimize(
        _objective,
        start[mask],
        args=(start, mask, obs),
        method="L-BFGS-B",
        jac=True,
        bounds=list(zip(lower[mask], upper[mask])),
        tol=1e-5,  # goodput.py: "changing tol to 1e-5 from machine precision for speed"
    )
    params = start.copy()
    params[mask] = result.x
    if not np.any(nodes > 1):  # goodput.py's prior: inter-node links are no faster than intra-node ones
        params[2] = max(params[2], params[4] * 1.1)
        params[3] = max(params[3], params[5] * 1.1)
    return PerfParams(*params.tolist())


def samples_per_s(
    params: PerfParams, batch: int, max_atomic: float, nodes: np.ndarray, replicas: np.ndarray
) -> np.ndarray:
    """Predicted samples/s of `batch` split over `replicas` (goodput.py GoodputFunction.throughput), each local
    batch in the fewest micro-batches of at most `max_atomic` (job.py update_local_bsz without batch tuning)."""
    p = np.asarray(params)
    local = batch / replicas
    accum_steps = np.ceil(local / max_atomic - 1e-8) - 1
    atomic = np.ceil(local / (accum_steps + 1) - 1e-8)
    accum = p[0] + p[1] * atomic
    total = accum_steps * accum + optim_seconds(p, accum, network_seconds(p, nodes, replicas))
    return batch / total
