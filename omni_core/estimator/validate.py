"""Validation against reality: run the real runtime for many plans, compare measured and predicted step time.

Each `Case` (flavor, world size, sequence length, micro-batch, gradient accumulation, modality mix) becomes a
recipe that `omni_core.runtime.trainer.train` runs for a few steps: in this process for world 1, and in one
torchrun launch per larger world size that runs all of its cases one after another. A step's time is the gap
between two consecutive per-step metric calls (log_every=1); the measurement is the median over the steps
after warm-up, on rank 0's CPU clock (a shared host's other tenants would otherwise be what is measured;
the wall-clock median is reported next to it). The prediction uses only the device's micro-profile
(`calibrate.py`, same clock), the dataset's profile and the loader's own speed on that data (measured
alone), never these step measurements. The micro-profile runs on CPU tensors only: GPU calibration is
not implemented yet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from itertools import pairwise
from pathlib import Path

from omni_core.estimator.catalog import GpuSpec
from omni_core.estimator.cost import Efficiency, Options, evaluate
from omni_core.estimator.workloads import omni_workload
from omni_core.parallel import ParallelPlan
from omni_core.results import Result
from omni_core.tracking import NullTracker

WARMUP = 2
MIXES = {
    "text": {"text": 1.0},
    "image": {"text": 0.2, "image": 0.8},
    "audio": {"text": 0.3, "audio": 0.7},
    "mixed": {"text": 0.4, "image": 0.4, "audio": 0.2},
}


@dataclass(frozen=True)
class Case:
    flavor: str
    world: int
    seq_len: int
    micro_batch: int = 1
    grad_accum: int = 1
    mix: str = "mixed"
    steps: int = 6

    @property
    def name(self) -> str:
        return f"{self.flavor}-w{self.world}-s{self.seq_len}-mb{self.micro_batch}-ga{self.grad_accum}-{self.mix}"

    @property
    def global_batch(self) -> int:
        return self.world * self.micro_batch * self.grad_accum


def case_recipe(case: Case, root: Path):
    """The recipe the runtime trains for a case: replicated DP (what this runtime executes), no checkpoints
    until the end, a metric call every step."""
    from omni_core.recipe import Recipe

    return Recipe.model_validate({
        "experiment": {"name": f"val-{case.mix}-s{case.seq_len}", "output_dir": str(root), "seed": 0},
        "data": {"synthetic": {"num_samples": 400, "mix": MIXES[case.mix]}, "seq_len": case.seq_len,
                 "micro_batch": case.micro_batch, "path": str(root / "data" / f"{case.mix}")},
        "model": {"flavor": case.flavor},
        "parallel": {"nproc": case.world, "dp_replicate": case.world, "dp_shard": 1},
        "train": {"steps": case.steps, "grad_accum": case.grad_accum, "warmup_steps": 1, "log_every": 1,
                  "ckpt_every": 0, "resume": False, "ckpt_dir": str(root / "ckpt" / case.name)},
    })


class _StepClock(NullTracker):
    """A tracker that only notes when each step's metrics arrive (log_every=1: once per step), on the wall
    clock and on this process's CPU clock."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def log_metrics(self, metrics, step: int) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())


def _median_gap(stamps: list[float]) -> float:
    return statistics.median([b - a for a, b in pairwise(stamps)][WARMUP - 1:])


def measure(case: Case, root: Path, info) -> dict[str, float]:
    """Median step seconds of the case on this process group (every rank calls it): wall clock, and the
    CPU time this rank's process got (what the steps cost when no other tenant competes for the cores)."""
    from omni_core.runtime.trainer import train

    clock = _StepClock()
    train(case_recipe(case, root), info, tracker=clock, log=lambda _: None)
    return {"wall_s": _median_gap(clock.wall), "cpu_s": _median_gap(clock.cpu)}


def validation_cases(quick: bool) -> list[Case]:
    """20 cases (world 1-4, debug and small, four mixes, micro-batch and accumulation) or, full, 26 with
    twice the steps."""
    d = "debug"
    steps = 6 if quick else 12
    cases = [Case(d, 1, 256, steps=steps), Case(d, 1, 512, mix="text", steps=steps),
             Case(d, 1, 512, mix="image", steps=steps), Case(d, 1, 512, mix="audio", steps=steps),
             Case(d, 1, 256, micro_batch=2, steps=steps), Case(d, 1, 256, grad_accum=2, steps=steps),
             Case(d, 1, 1024, steps=steps), Case(d, 1, 512, grad_accum=2, mix="image", steps=steps),
             Case("small", 1, 128, steps=4 if quick else 8),
             Case(d, 2, 256, steps=steps), Case(d, 2, 512, mix="image", steps=steps),
             Case(d, 2, 512, mix="text", steps=steps), Case(d, 2, 256, micro_batch=2, steps=steps),
             Case("small", 2, 64, steps=4 if quick else 8),
             Case(d, 3, 256, steps=steps), Case(d, 3, 512, mix="text", steps=steps),
             Case(d, 4, 256, steps=steps), Case(d, 4, 512, mix="audio", steps=steps),
             Case(d, 4, 256, mix="text", steps=steps), Case(d, 1, 512, mix="mixed", steps=steps)]
    if not quick:
        cases += [Case("small", 1, 256, mix="image", steps=8), Case("small", 2, 128, mix="text", steps=8),
                  Case(d, 2, 1024, steps=steps), Case(d, 3, 256, micro_batch=2, steps=steps),
                  Case(d, 4, 512, mix="image", steps=steps), Case("small", 4, 64, steps=6)]
    return cases


class CaseResult(Result):
    case: str
    world: int
    flavor: str
    predicted_s: float
    measured_s: float  # median CPU seconds per step of rank 0's process
    measured_wall_s: float  # median wall seconds per step (includes waiting for the cores)
    ape_pct: float


class ValidationReport(Result):
    device: str
    rows: list[CaseResult]
    mape_pct: float
    mape_pct_by_world: dict[str, float]
    calibration: dict[str, float]
    seconds: float


def predict(case: Case, profile, spec: GpuSpec, eff: Efficiency, *, loader_s: float = 0.0) -> float:
    """Predicted step seconds: the cost model on the calibrated device with the runtime's plan (replicated
    DP, encoders on every rank with no rebalancing: the `coupled` layout at pp=1), plus `loader_s` of host
    data path per micro-batch."""
    from omni_core.models.flavors import get_flavor

    recipe_data = case_recipe(case, Path("/nonexistent")).data
    args = get_flavor(case.flavor, patch_size=recipe_data.patch_size, n_mels=recipe_data.n_mels)
    workload = omni_workload(args, seq_len=case.seq_len, global_batch=case.global_batch, profile=profile,
                             precision="fp32", name=case.name)
    plan = ParallelPlan(dp_replicate=case.world)
    eff = replace(eff, step_overhead_s=loader_s * case.grad_accum)
    options = Options(micro_batch=case.micro_batch, layout="coupled")
    return evaluate(workload, spec, plan, options, gpus_per_node=case.world, eff=eff).step_time_s


def _run_world(cases: list[Case], root: Path, world: int, timeout_s: float) -> dict[str, dict[str, float]]:
    if world == 1:
        import torch

        from omni_core.runtime.dist import DistInfo

        info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
        return {c.name: measure(c, root, info) for c in cases}
    spec = root / f"cases-w{world}.json"
    out = root / f"measured-w{world}.json"
    spec.write_text(json.dumps([asdict(c) for c in cases]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "omni_core.estimator.validate", "--worker", str(spec), "--out", str(out), "--root", str(root)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, timeout=timeout_s, env=env, start_new_session=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return json.loads(out.read_text())


def _profile(case: Case, root: Path):
    from omni_core.data.profile import profile_dataset

    return profile_dataset(case_recipe(case, root), root / "profiles" / f"{case.mix}-s{case.seq_len}")[0]


def loader_seconds(case: Case, root: Path, batches: int = 8) -> float:
    """Host data path: median seconds for the runtime's loader to read, decode and pack one micro-batch of
    this case's data (measured alone, before any training step)."""
    from omni_core.data.dataset import ManifestDataset
    from omni_core.data.loader import PackedLoader
    from omni_core.data.synthetic import ensure_dataset

    recipe = case_recipe(case, root)
    loader = iter(PackedLoader(ManifestDataset(ensure_dataset(recipe), recipe.data), recipe.data, "train", 0, 1, 0))
    next(loader)
    times = []
    for _ in range(batches):
        start = time.process_time()
        next(loader)
        times.append(time.process_time() - start)
    return statistics.median(times)


def validate(cases: list[Case], root: Path, spec: GpuSpec, eff: Efficiency, *,
             timeout_s: float = 600.0) -> ValidationReport:
    """Measure every case on the real runtime, predict each from the calibration, report the errors
    against the steps' CPU time (and, for reference, how much longer they took on the wall)."""
    started = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    profiles, loaders = {}, {}
    for case in cases:  # profiles (and the synthetic data) first, so no measured step pays for generation
        key = (case.mix, case.seq_len)
        if key not in profiles:
            profiles[key] = _profile(case, root)
        if (*key, case.micro_batch) not in loaders:
            loaders[(*key, case.micro_batch)] = loader_seconds(case, root)
    measured: dict[str, dict[str, float]] = {}
    for world in sorted({c.world for c in cases}):
        measured.update(_run_world([c for c in cases if c.world == world], root, world, timeout_s))
    rows = []
    for case in cases:
        real = measured[case.name]
        predicted = predict(case, profiles[(case.mix, case.seq_len)], spec, eff,
                            loader_s=loaders[(case.mix, case.seq_len, case.micro_batch)])
        rows.append(CaseResult(case=case.name, world=case.world, flavor=case.flavor, predicted_s=predicted,
                               measured_s=real["cpu_s"], measured_wall_s=real["wall_s"],
                               ape_pct=100 * abs(predicted - real["cpu_s"]) / real["cpu_s"]))
    by_world = {str(w): statistics.mean(r.ape_pct for r in rows if r.world == w) for w in sorted({r.world for r in rows})}
    return ValidationReport(device=spec.name, rows=rows, mape_pct=statistics.mean(r.ape_pct for r in rows),
                            mape_pct_by_world=by_world, calibration={k: float(v) for k, v in asdict(eff).items()},
                            seconds=time.perf_counter() - started)


def calibrate_and_validate(quick: bool, root: Path, device: str = "cpu") -> tuple[ValidationReport, dict]:
    """Micro-profile this device (2 ranks), then validate `validation_cases(quick)` against it; returns the
    report and the raw calibration. The CPU runtime all-reduces after backward: no DP overlap. Kernels and
    steps are both timed in process CPU time, so that the other tenants of a shared host are not what is
    measured; wall times are kept in the report."""
    from omni_core.estimator.calibrate import calibrate
    from omni_core.estimator.catalog import GpuCatalog

    spec, eff, raw = calibrate(GpuCatalog()[device], world=2, repeat=5 if quick else 10, save=False,
                               clock=time.process_time)
    report = validate(validation_cases(quick), root, spec, replace(eff, dp_overlap=0.0))
    return report, raw


def validation_figure(report: ValidationReport, path: Path) -> Path:
    """Predicted against measured step time per case, one colour per world size, with the y = x line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for world in sorted({r.world for r in report.rows}):
        rows = [r for r in report.rows if r.world == world]
        ax.scatter([r.measured_s for r in rows], [r.predicted_s for r in rows],
                   label=f"world {world}: MAPE {report.mape_pct_by_world[str(world)]:.1f}%")
    lo = min(min(r.measured_s, r.predicted_s) for r in report.rows)
    hi = max(max(r.measured_s, r.predicted_s) for r in report.rows)
    ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1)
    ax.set(xscale="log", yscale="log", xlabel="measured step time (s)", ylabel="predicted step time (s)",
           title=f"{report.device}: MAPE {report.mape_pct:.1f}% over {len(report.rows)} plans")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _worker(args: argparse.Namespace) -> None:
    """Under torchrun: every rank measures every case of this world size; rank 0 writes the results."""
    from omni_core.runtime.dist import init_distributed, shutdown

    info = init_distributed("auto", 300.0)
    cases = [Case(**c) for c in json.loads(Path(args.worker).read_text())]
    results = {c.name: measure(c, Path(args.root), info) for c in cases}
    if info.is_main:
        Path(args.out).write_text(json.dumps(results))
    shutdown(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="torchrun worker of the estimator's validation")
    parser.add_argument("--worker", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--root", required=True)
    _worker(parser.parse_args())
