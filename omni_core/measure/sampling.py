"""How every calibration probe is timed and fitted: interleaved sampling of a set of probes (a shared host's
speed drifts within a second, and a training step averages over its states), least-squares fits of per-unit
costs, and the count of aten operators a probe dispatches."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

SAMPLE_SECONDS = 0.01  # the shortest sample of a kernel probe

Key = TypeVar("Key", bound=Hashable)
Probes = dict[Hashable, Callable[[], object]]  # a set of probes sampled together, by name


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope), intercept clamped at >= 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return max(0.0, my - slope * mx), slope


def fit_costs(features: list[tuple[float, ...]], seconds: list[float]) -> tuple[float, ...]:
    """Non-negative per-unit costs c with seconds ~ features . c, least squares on the relative error (small
    and large probes count alike); a cost the fit would make negative is dropped (set to 0) and the rest refit."""
    import numpy as np

    x = np.array(features, dtype=float) / np.array(seconds)[:, None]
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active] = np.linalg.lstsq(x[:, active], np.ones(len(seconds)), rcond=None)[0]
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return tuple(float(c) for c in coef)
        active.remove(min(negative, key=lambda i: coef[i]))


def count_ops(fn: Callable[[], object]) -> int:
    """Aten operators `fn` dispatches (forward and backward), as `transformer_layers` counted the model's
    modules."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.ops


def sample(
    probes: Mapping[Key, Callable[[], object]],
    passes: int,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], object] | None = None,
) -> dict[Key, float]:
    """Mean seconds of each probe's run over `passes` round-robin passes.

    A shared host's cores switch between a fast and a slow state every 0.1-1 s (operator dispatch and matmuls
    both slow at once), so a probe timed in one burst measures one state, while a training step runs through
    several. Interleaving spreads every probe over the whole calibration, and the mean (not the median) of its
    passes is what a long run averages to.

    Alone, a probe's warm-up run sets how many runs make one of its samples (at least SAMPLE_SECONDS: a
    single run right after another probe's large buffers pays for cold caches, which a long stream of
    operators does not). With `sync` (a barrier before each sample: ranks start collectives together) every
    sample is one run, so that all ranks run the same calls."""
    runs = {}
    for key, fn in probes.items():
        if sync:
            sync()
        start = clock()
        fn()
        runs[key] = 1 if sync else max(1, round(SAMPLE_SECONDS / max(clock() - start, 1e-6)))
    totals = dict.fromkeys(probes, 0.0)
    for _ in range(passes):
        for key, fn in probes.items():
            if sync:
                sync()
            start = clock()
            for _ in range(runs[key]):
                fn()
            totals[key] += clock() - start
    return {key: total / (passes * runs[key]) for key, total in totals.items()}
