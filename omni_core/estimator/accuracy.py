"""How far the estimator's step times are from measured ones, in log2 errors: summaries of a set of rows, the same
per group, and the rank correlation across a model's topologies. The published-table check (`published`) and
the held-out artifact check (`arena`) report in these terms."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

Row = dict[str, Any]  # one priced measurement: at least predicted_s, measured_s, log2_error and its grouping keys


def summary(errors: Sequence[float]) -> dict[str, float]:
    """Rows, median |log2 error|, median signed log2 error (negative: optimistic), share within 1.5x."""
    return {
        "rows": len(errors),
        "median_abs_log2": statistics.median(abs(e) for e in errors),
        "median_log2": statistics.median(errors),
        "within_1_5x_share": sum(abs(e) <= math.log2(1.5) for e in errors) / len(errors),
    }


def grouped_summary(rows: list[Row], key: str) -> dict[Any, dict[str, float]]:
    """`summary` of the rows' log2 errors per value of `key`, in key order."""
    groups: dict[Any, list[float]] = defaultdict(list)
    for r in rows:
        groups[r[key]].append(r["log2_error"])
    return {k: summary(e) for k, e in sorted(groups.items())}


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences (ties ranked in order)."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def family_spearman(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Per family, over models with at least three topologies: the mean rank correlation across a model's
    topologies (a model at one batch and recomputation; rows without those keys are the held-out check's, one
    per Cell); null with the reason when no model of the family has three."""
    by_family: dict[str, dict[tuple, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["measured_s"] is not None:
            by_family[r["family"]][r["model"], r.get("global_batch"), r.get("recompute")].append(r)
    out: dict[str, dict[str, Any]] = {}
    for family, models in by_family.items():
        rhos = [
            spearman([r["predicted_s"] for r in rs], [r["measured_s"] for r in rs])
            for rs in models.values()
            if len(rs) >= 3
        ]
        out[family] = (
            {"spearman": statistics.fmean(rhos), "models": len(rhos)}
            if rhos
            else {"spearman": None, "why": "no model of this family has three topologies in the table"}
        )
    return out


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for rank, i in enumerate(order):
        out[i] = float(rank)
    return out
