"""Drift of a data stream, a window at a time: each window's token-length counts (pooled and per modality)
against the first window's by the two-sample Kolmogorov-Smirnov statistic, and its modality mix by the
total-variation distance; a window drifts where one exceeds the threshold and is significant."""

from __future__ import annotations

import numpy as np

from omni_core.data.profile_result import DriftWindow
from omni_core.data.sample import KINDS

KS_CRITICAL = 1.949  # c(alpha) of the two-sample Kolmogorov-Smirnov test at alpha = 0.001
MIN_KS_SAMPLES = 20  # per-modality KS only when both windows hold at least this many of the modality


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic of two count arrays over the same integer values."""
    size = max(len(a), len(b))
    cdf_a = np.cumsum(np.pad(a, (0, size - len(a)))) / a.sum()
    cdf_b = np.cumsum(np.pad(b, (0, size - len(b)))) / b.sum()
    return float(np.abs(cdf_a - cdf_b).max())


def significant(n: int, m: int) -> float:
    """Smallest KS statistic significant at alpha = 0.001 for samples of n and m."""
    return KS_CRITICAL * float(np.sqrt((n + m) / (n * m)))


class TokenWindow:
    """Per-modality token-length counts of one window."""

    def __init__(self, modality: np.ndarray, tokens: np.ndarray) -> None:
        self.count = len(tokens)
        self.pooled = np.bincount(tokens)
        self.by_modality = {
            m: np.bincount(tokens[modality == code]) for code, m in enumerate(KINDS) if (modality == code).any()
        }
        self.sizes = {m: int(c.sum()) for m, c in self.by_modality.items()}
        self.tokens_mean = float(tokens.mean())

    def shares(self) -> np.ndarray:
        return np.array([self.sizes.get(m, 0) / self.count for m in KINDS])


def drift_window(window: TokenWindow, reference: TokenWindow, start: int, threshold: float) -> DriftWindow:
    """`window` (its first sample the `start`-th of the stream) against the `reference` window."""
    ref = reference
    ks = ks_statistic(window.pooled, ref.pooled)
    ks_by = {
        m: ks_statistic(c, ref.by_modality[m])
        for m, c in window.by_modality.items()
        if m in ref.by_modality and min(window.sizes[m], ref.sizes[m]) >= MIN_KS_SAMPLES
    }
    mix = 0.5 * float(np.abs(window.shares() - ref.shares()).sum())
    drift = (
        ks > max(threshold, significant(window.count, ref.count))
        or mix > max(threshold, significant(window.count, ref.count))
        or any(v > max(threshold, significant(window.sizes[m], ref.sizes[m])) for m, v in ks_by.items())
    )
    return DriftWindow(
        start=start,
        count=window.count,
        shares={m: float(s) for m, s in zip(KINDS, window.shares()) if s},
        tokens_mean=window.tokens_mean,
        ks=ks,
        ks_by_modality=ks_by,
        mix_distance=mix,
        drift=drift,
    )
