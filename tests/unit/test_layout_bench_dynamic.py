"""benchmarks/layout_bench.py --dynamic: each step is priced on the data drawn at it (the schedule's mix there,
held, over enough packed sequences that the last, partly filled one is noise), under each calibration made
between the runs, and the run reports the median calibration's predictions."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from omni_core.common.catalog import GpuCatalog
from omni_core.common.plan import ParallelPlan
from omni_core.estimator.calibration import store_calibration
from omni_core.estimator.terms import Efficiency

ROOT = Path(__file__).resolve().parents[2]
STEPS = (1, 20)


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import layout_bench

    return layout_bench


def test_a_step_is_priced_on_the_mix_drawn_at_it_in_full_sequences(bench, tmp_path):
    recipe = bench.bench_recipe(tmp_path, bench.drift_case(STEPS), ParallelPlan.parse("dp1-pp2+omni"))
    first, middle, last = (bench.step_profile(recipe, s) for s in (STEPS[0], 10, sum(STEPS) - 1))
    assert first.modalities["image"].share == pytest.approx(bench.DRIFT[0]["image"], abs=0.03)
    assert middle.modalities["image"].share == pytest.approx(0.1 + 0.8 * 9 / 19, abs=0.04)  # interpolated
    assert last.modalities["image"].share == pytest.approx(bench.DRIFT[1]["image"], abs=0.03)
    # a window of a step's own size packed 2-4 sequences, 0.63-0.81 full; the loader's are 0.99
    assert min(p.packing_efficiency for p in (first, middle, last)) > 0.97


def test_each_calibration_prices_the_same_steps(bench, tmp_path, monkeypatch):
    cpu = GpuCatalog()["cpu"]
    folders = []
    for name, flops in (("fast", 2 * cpu.fp32_flops), ("slow", cpu.fp32_flops / 2)):
        monkeypatch.setenv("OMNI_CALIBRATION_DIR", str(tmp_path / name))
        store_calibration(replace(cpu, fp32_flops=flops, bf16_flops=flops, fp16_flops=flops), Efficiency(), {})
        folders.append(str(tmp_path / name))
    plans = {"omni": ParallelPlan.parse("dp1-pp2+omni")}
    fast, slow = bench.priced_steps(tmp_path, (1, 2), plans, folders)
    assert len(fast["omni"]) == len(slow["omni"]) == 2
    assert all(s.step_time_s > f.step_time_s for f, s in zip(fast["omni"], slow["omni"], strict=True))


def test_the_run_reports_the_median_calibration(bench):
    def priced(*steps: float) -> dict[str, list]:
        return {"coupled": [SimpleNamespace(step_time_s=s) for s in steps], "omni": [SimpleNamespace(step_time_s=1.0)]}

    assert bench.median_calibration([priced(3.0, 3.0), priced(1.0), priced(2.0, 0.5)]) == 2
    assert bench.median_calibration([priced(3.0), priced(1.0)]) == 1  # of two, the faster
