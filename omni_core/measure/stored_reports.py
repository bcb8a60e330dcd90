"""A stored validation report read back: its keys, and its measurements predicted again by this checkout's cost
model from the report's own calibrations (`validate.repredict`). Rounds of one case move by tens of percent on
a shared host, as much as a model change moves the error, so a change is judged on the same measurements
before and after (`benchmarks/estimator_bench.py --repredict`)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from omni_core.common.catalog import GpuCatalog
from omni_core.measure.validate import repredict
from omni_core.measure.validation_report import CaseResult, ValidationReport


class ReportError(ValueError):
    """A stored report this module cannot read or predict again; the message names the file."""


def validation_keys(report: ValidationReport) -> dict[str, Any]:
    """The validation's summary keys, as every validation report stores them."""
    return {
        "mape_pct": report.mape_pct,
        "mape_pct_by_world": report.mape_pct_by_world,
        "n_plans_validated": len(report.rows),
        "validation_rounds": report.rounds,
        "measured_spread_pct": report.measured_spread_pct,
        "predicted_spread_pct": report.predicted_spread_pct,
    }


def repredicted(source: Path) -> dict[str, Any]:
    """The validation stored in `source` (an estimator_bench or GPU validation report of CPU ranks) predicted
    again: the validation's keys and rows, beside the report's own `source_mape_pct`."""
    try:
        stored = json.loads(source.read_text())
        rows = [CaseResult.model_validate(row) for row in stored["validation"]]
        calibrations = stored["calibration"]
    except (OSError, ValueError) as exc:
        raise ReportError(f"{source}: not an estimator_bench report ({exc})") from exc
    except KeyError as exc:
        raise ReportError(f"{source}: an estimator_bench report lacks the field {exc}") from exc
    with tempfile.TemporaryDirectory(prefix="omni-repredict-") as tmp:
        try:
            report = repredict(rows, calibrations, Path(tmp), GpuCatalog()["cpu"])
        except ValueError as exc:
            raise ReportError(f"{source}: {exc}") from exc
    return {
        **validation_keys(report),
        "repredicted_from": str(source),
        "source_mape_pct": stored["mape_pct"],
        "source_mape_pct_by_world": stored["mape_pct_by_world"],
        "validation": [r.model_dump() for r in report.rows],
        "calibration": report.calibration,
    }
