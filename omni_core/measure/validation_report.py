"""The validation's report: each case's predicted against measured step time over the rounds, the mean
absolute percentage error overall and per world size, how much the host itself moved between rounds, and
the figure of predicted against measured."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from omni_core.common.results import Result
from omni_core.estimator.cost import Estimate
from omni_core.measure.cases import Case


class CaseResult(Result):
    """One case's predicted and measured step time, each round's and their means, and the error."""

    case: str
    world: int
    flavor: str
    plan: str
    predicted_s: float  # the mean over rounds of each round's prediction
    measured_s: float  # the mean over rounds of rank 0's mean wall seconds per step
    measured_cpu_s: float  # of which rank 0's process was on a core (CPU time)
    waited_s: float  # of which rank 0 was ready to run but waited for a core
    ape_pct: float
    predicted_rounds_s: list[float]
    measured_rounds_s: list[float]
    breakdown: dict[str, float]  # each term's mean over rounds


class ValidationReport(Result):
    """Every case's result, the errors over them, and the calibrations the predictions came from."""

    device: str
    rows: list[CaseResult]
    rounds: int
    mape_pct: float
    mape_pct_by_world: dict[str, float]
    # how much the host itself moves: the mean over cases of (max - min) / median across rounds (None: 1 round)
    measured_spread_pct: float | None
    predicted_spread_pct: float | None
    calibration: list[dict[str, Any]]  # each round's kernels (per case) and its links and wrapper costs
    seconds: float


def _spread(values: list[float]) -> float:
    """(max - min) / median, in percent."""
    return 100 * (max(values) - min(values)) / statistics.median(values)


def build_report(
    cases: list[Case],
    estimates: dict[str, list[Estimate]],
    measured: dict[str, list[dict[str, float]]],
    calibrations: list[dict[str, Any]],
    device: str,
    rounds: int,
    started: float,
) -> ValidationReport:
    """Each case's rounds of predictions and measurements, compared."""
    rows = []
    for case in cases:
        ests = estimates[case.name]
        predicted = statistics.mean(e.step_time_s for e in ests)
        real = {key: statistics.mean(r[key] for r in measured[case.name]) for key in measured[case.name][0]}
        rows.append(
            CaseResult(
                case=case.name,
                world=case.world,
                flavor=case.flavor,
                plan=case.plan,
                predicted_s=predicted,
                measured_s=real["wall_s"],
                measured_cpu_s=real["cpu_s"],
                waited_s=real["delay_s"],
                ape_pct=100 * abs(predicted - real["wall_s"]) / real["wall_s"],
                predicted_rounds_s=[e.step_time_s for e in ests],
                measured_rounds_s=[r["wall_s"] for r in measured[case.name]],
                breakdown={k: statistics.mean(float(e.breakdown[k]) for e in ests) for k in ests[0].breakdown},
            )
        )
    worlds = sorted({r.world for r in rows})
    by_world = {str(w): statistics.mean(r.ape_pct for r in rows if r.world == w) for w in worlds}

    def spread(key: str) -> float | None:
        return statistics.mean(_spread(getattr(r, key)) for r in rows) if rounds > 1 else None

    return ValidationReport(
        device=device,
        rows=rows,
        rounds=rounds,
        mape_pct=statistics.mean(r.ape_pct for r in rows),
        mape_pct_by_world=by_world,
        measured_spread_pct=spread("measured_rounds_s"),
        predicted_spread_pct=spread("predicted_rounds_s"),
        calibration=calibrations,
        seconds=time.perf_counter() - started,
    )


def validation_figure(report: ValidationReport, path: Path) -> Path:
    """Predicted against measured step time per case, one colour per world size, with the y = x line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for world in sorted({r.world for r in report.rows}):
        rows = [r for r in report.rows if r.world == world]
        ax.scatter(
            [r.measured_s for r in rows],
            [r.predicted_s for r in rows],
            label=f"world {world}: MAPE {report.mape_pct_by_world[str(world)]:.1f}%",
        )
    lo = min(min(r.measured_s, r.predicted_s) for r in report.rows)
    hi = max(max(r.measured_s, r.predicted_s) for r in report.rows)
    ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="measured step time (s)",
        ylabel="predicted step time (s)",
        title=f"{report.device}: MAPE {report.mape_pct:.1f}% over {len(report.rows)} plans",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
