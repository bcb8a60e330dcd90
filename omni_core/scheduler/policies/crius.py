"""Crius (the Crius paper's scheduler) with a response-ratio admission term for waiting jobs, and the two
allocation passes it is built from: greedy growth by marginal gain in cluster throughput (samples/s) per GPU
(`greedy`) and halving running jobs so a waiting one can start (`shrink_to_start`).

Crius starts from what runs now: opportunistic starts of queued jobs, growing a running job or changing its
GPU type, then shrinking running jobs where that lets a waiting job start for a net gain; placement migrates
jobs to undo fragmentation. A change is worth less by the share of its amortisation window lost to a
restart; a waiting job is worth more by its response ratio (waited + run) / run, so admission under
contention does not hang on the shrink's throughput gain alone and no job waits unboundedly.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import numpy as np

from omni_core.scheduler.jobs import Config, Job
from omni_core.scheduler.policies.base import Cell, Policy, View, configs_of

AMORTISE_S = 3600.0  # a restart is weighed against at most this much of the job's remaining run
# Plan search on a config new to the job, per GPU and capped (Crius artifact macro_def.py): Crius's pruned
# Cells (RESCHED_OVERHEAD_WITH_PRUNE, MAX_RESCHED_OVERHEAD_WITH_PRUNE).
CRIUS_SEARCH_S = (10.0, 40.0)

Move = tuple[float, int, int, int]  # (-gain per extra GPU, job, the job's version when queued, count column)
Victim = tuple[float, int, Cell]  # (loss per GPU freed by halving, job, the cell it held when queued)


def greedy(
    values: Sequence[np.ndarray], counts: Sequence[int], capacity: np.ndarray, start: Sequence[Cell | None]
) -> list[Cell | None]:
    """Greedy by marginal gain per GPU. `values[j][t, c]` is job j's worth on counts[c] GPUs of type t
    (NaN or <= 0: not allowed); jobs start from `start`. Repeatedly take the move (a first config, or a
    more valuable one) with the largest gain per extra GPU that fits in what is free. Moves are queued per
    GPU type and a type with no free GPU is passed over (until a type change frees one), so a full cluster
    does not pop every queued move one by one."""
    n = np.asarray(counts, dtype=float)
    held = list(start)
    free = capacity.astype(float).copy()
    for h in held:
        if h is not None:
            free[h[0]] -= n[h[1]]
    version = [0] * len(values)
    heaps = _first_moves(values, n, held, len(capacity))

    def moves(j: int) -> Iterator[tuple[int, Move]]:
        cell = held[j]
        now_v, now_n = (0.0, 0.0) if cell is None else (values[j][cell], n[cell[1]])
        delta = values[j] - now_v
        gain = delta / np.maximum(n[None, :] - now_n, 1.0)
        for t, c in zip(*np.nonzero(np.nan_to_num(delta, nan=0.0) > 1e-9)):
            yield int(t), (-gain[t, c], j, version[j], int(c))

    while True:
        live = [t for t, h in enumerate(heaps) if h and free[t] > 0]
        if not live:
            return held
        t = min(live, key=lambda k: heaps[k][0])
        _, j, ver, c = heapq.heappop(heaps[t])
        was = held[j]
        returned = n[was[1]] if was is not None and was[0] == t else 0.0
        if ver != version[j] or free[t] + returned < n[c]:
            continue  # stale, or no longer fits
        if was is not None:
            free[was[0]] += n[was[1]]
        free[t] -= n[c]
        held[j] = (t, c)
        version[j] += 1
        for k, move in moves(j):
            heapq.heappush(heaps[k], move)


def _first_moves(
    values: Sequence[np.ndarray], n: np.ndarray, held: Sequence[Cell | None], types: int
) -> list[list[Move]]:
    """Every job's moves from where it starts, one heap per GPU type, computed for all jobs at once (a loop
    over jobs would dominate a large decision's cost): (-gain per extra GPU, job, version 0, count)."""
    heaps: list[list[Move]] = [[] for _ in range(types)]
    if not values:
        return heaps
    v = np.stack(values)
    rows = np.arange(len(values))
    cells = np.array([h if h is not None else (0, 0) for h in held]).reshape(-1, 2)
    running = np.array([h is not None for h in held])
    now_v = np.where(running, v[rows, cells[:, 0], cells[:, 1]], 0.0)
    now_n = np.where(running, n[cells[:, 1]], 0.0)
    delta = v - now_v[:, None, None]
    gain = delta / np.maximum(n[None, None, :] - now_n[:, None, None], 1.0)
    j, t, c = np.nonzero(np.nan_to_num(delta, nan=0.0) > 1e-9)
    for k in range(types):
        on = t == k
        heaps[k] = list(zip((-gain[j[on], k, c[on]]).tolist(), j[on].tolist(), [0] * int(on.sum()), c[on].tolist()))
        heapq.heapify(heaps[k])
    return heaps


def shrink_to_start(
    values: Sequence[np.ndarray],
    counts: Sequence[int],
    capacity: np.ndarray,
    held: list[Cell | None],
    waiting: Sequence[int],
) -> None:
    """For each waiting job (in the order given), halve running jobs of one GPU type, cheapest loss per freed
    GPU first, and start it on the count of that type with the largest net gain (its value there minus what
    the halved jobs lose), if any is positive. In place. Free GPUs and one heap of halving candidates per
    type are kept across the waiting jobs, so a try costs the victims it looks at, not a pass over every
    running job."""
    n = np.asarray(counts)
    free = capacity.astype(float).copy()
    for h in held:
        if h is not None:
            free[h[0]] -= n[h[1]]
    heaps: list[list[Victim]] = [[] for _ in capacity]

    def push(i: int, cell: Cell) -> None:
        t, c = cell
        if c > 0 and np.nan_to_num(values[i][t, c - 1], nan=0.0) > 0:
            heapq.heappush(heaps[t], ((values[i][t, c] - values[i][t, c - 1]) / (n[c] / 2), i, (t, c)))

    for i, h in enumerate(held):
        if h is not None:
            push(i, h)
    for j in waiting:
        tries = [_shrink_try(values[j][t], n, free[t], heaps[t], held) for t in range(len(capacity))]
        best = max(range(len(tries)), key=lambda t: tries[t][0])
        for t, (net, _, taken, rest) in enumerate(tries):
            for entry in rest if t == best and net > 0 else taken + rest:
                heapq.heappush(heaps[t], entry)
        net, c, taken, _ = tries[best]
        if net > 0:
            for _, i, (_, ci) in taken:
                held[i] = (best, ci - 1)
                free[best] += n[ci] / 2
                push(i, (best, ci - 1))
            held[j] = (best, c)
            free[best] -= n[c]


def _shrink_try(
    value: np.ndarray, n: np.ndarray, free: float, heap: list[Victim], held: list[Cell | None]
) -> tuple[float, int, list[Victim], list[Victim]]:
    """The best start of a waiting job worth `value` per count on one type by halving victims from `heap`:
    (net gain, count, victims it halves, victims popped beyond those). Victims are popped, not kept: the
    caller pushes back what it does not halve."""
    freed, loss = free, 0.0
    popped: list[Victim] = []
    best = (0.0, -1, 0)  # net, count, victims
    for c in np.flatnonzero(np.nan_to_num(value, nan=0.0) > 0):
        while freed < n[c] and heap:
            entry = heapq.heappop(heap)
            if held[entry[1]] != entry[2]:
                continue  # stale: that job was halved already
            popped.append(entry)
            freed += n[entry[2][1]] / 2
            loss += entry[0] * n[entry[2][1]] / 2
        if freed < n[c]:
            break
        if value[c] - loss > best[0]:
            best = (value[c] - loss, int(c), len(popped))
    return best[0], best[1], popped[: best[2]], popped[best[2] :]


class Crius(Policy):
    """Crius (the Crius paper's scheduler) with a response-ratio admission term for waiting jobs.

    `queue_window_per_gpu`: waiting jobs a decision considers, per GPU of the cluster (0.2: the 256 oldest on
    the study's 1,280 GPUs, more than can start at once), so the limit grows with the cluster; never fewer
    than `queue_window_min` (a small cluster's decisions are cheap, and its queue may be long)."""

    name = "crius"

    def __init__(
        self,
        search_s_per_gpu: float = CRIUS_SEARCH_S[0],
        search_max_s: float = CRIUS_SEARCH_S[1],
        queue_window_per_gpu: float = 0.2,
        queue_window_min: int = 256,
        *,
        search_every_start: bool = False,
    ):
        super().__init__(search_s_per_gpu, search_max_s, search_every_start=search_every_start)
        self.queue_window_per_gpu, self.queue_window_min = queue_window_per_gpu, queue_window_min

    def decide(self, view: View) -> dict[str, Config]:
        jobs = view.considered(max(self.queue_window_min, int(self.queue_window_per_gpu * view.cluster.total_gpus)))
        values = [self.value(view, job) for job in jobs]
        counts, capacity = view.table.counts, view.table.capacity
        held = greedy(values, counts, capacity, [view.cell(job) for job in jobs])
        per_gpu = np.asarray(counts, dtype=float)
        waiting = sorted(
            (j for j, h in enumerate(held) if h is None),
            key=lambda j: -np.nanmax(np.nan_to_num(values[j], nan=0.0) / per_gpu),
        )
        if waiting:
            shrink_to_start(values, counts, capacity, held, waiting)
            held = greedy(values, counts, capacity, held)  # hand out what shrinking left over
        return configs_of(view.table, held, jobs)

    def value(self, view: View, job: Job) -> np.ndarray:
        """Throughput per config, samples/s: what Crius maximises over the cluster, as the Crius artifact's
        marginal gains are deltas of samples/s (scheduler.py `_get_delta_thr`, e3c8535). A running job's other
        configs lose the share of their amortisation window a restart (restore and plan search) takes; a
        waiting job's configs gain its response ratio, 1 + waited / remaining run on its most GPU-efficient
        config: no extra while it has not waited, growing with the wait and larger for short jobs
        (highest-response-ratio-next), so every waiting job is admitted eventually, short ones first. One
        factor for all its configs, so which count it gets is still a question of throughput."""
        values = view.table.rates(job)
        run_s = view.run_s(job)
        cell = view.cell(job)
        if cell is None:
            efficient = np.nanargmax(values / np.asarray(view.table.counts, dtype=float)[None, :])
            return values * (1.0 + max(view.now - job.arrival_s, 0.0) / run_s.flat[efficient])
        restart = view.restart_s + self.search_s(view.table.counts)[None, :]
        out = values * np.clip(1.0 - restart / np.minimum(run_s, AMORTISE_S), 0.0, 1.0)
        out[cell] = values[cell]
        return out
