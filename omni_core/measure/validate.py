"""Validation against reality: run the real runtime under many plans, compare measured and predicted step time.

Each `Case` (flavor, `ParallelPlan` name, sequence length, micro-batch, gradient accumulation, modality mix)
becomes a recipe that `omni_core.runtime.trainer.train` runs for a few steps on as many local gloo ranks as
the plan has (forked from this process, one launch per world size running all of its cases in turn). A
step's time is the gap between two consecutive per-step metric calls (log_every=1) on rank 0; the
measurement is the mean over the steps after warm-up, on the wall clock (a pipeline's bubbles and a
collective's waiting are only there), with the seconds rank 0 waited for a core alongside it: a step that
waited much longer than the ranks' own sharing of the cores explains was measured on a loaded host.

The prediction uses only the device's micro-profile (`calibrate.py`), the dataset's profile and the
loader's own speed on that data (measured alone), never these step measurements. On GPUs (`at` =
`calibrate.CUDA_PROBES`, `gpu_validation_cases`) the same runs are spawned NCCL ranks, one per GPU, training
in bf16; the kernels are profiled on the GPU and the links by NCCL collectives among the case's GPUs.
"""

from __future__ import annotations

import gc
import os
import re
import statistics
import time
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path

from omni_core.common.catalog import GpuSpec
from omni_core.common.plan import ParallelPlan
from omni_core.common.results import Result
from omni_core.estimator.calibration import runtime_efficiency
from omni_core.estimator.cost import Efficiency, Options, estimate_step
from omni_core.estimator.omni_workloads import omni_workload
from omni_core.measure.calibrate import CPU_PROBES, ProbeDevice
from omni_core.runtime.ranks import run_ranks
from omni_core.tracking import NullTracker

WARMUP = 2  # steps left out: the first builds pipeline shapes and grows the allocator
MIXES = {
    "text": {"text": 1.0},
    "image": {"text": 0.2, "image": 0.8},
    "audio": {"text": 0.3, "audio": 0.7},
    "mixed": {"text": 0.4, "image": 0.4, "audio": 0.2},
}


@dataclass(frozen=True)
class Case:
    """One validation run: a model flavor under a plan (`ParallelPlan` name; its world size is the number of
    ranks), a packed sequence length, micro-batch, gradient accumulation and data mix."""

    flavor: str
    plan: str
    seq_len: int
    micro_batch: int = 1
    grad_accum: int = 1
    mix: str = "mixed"
    steps: int = 6

    @property
    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan.parse(self.plan)

    @property
    def world(self) -> int:
        return self.parallel_plan.world_size

    @property
    def name(self) -> str:
        return f"{self.flavor}-{self.plan}-s{self.seq_len}-mb{self.micro_batch}-ga{self.grad_accum}-{self.mix}"

    @property
    def global_batch(self) -> int:
        return self.parallel_plan.dp * self.micro_batch * self.grad_accum


def case_recipe(case: Case, root: Path, at: ProbeDevice = CPU_PROBES):
    """The recipe the runtime trains for a case: its plan, the probed device's dtype (float32 on CPU, bfloat16
    on GPUs), a metric call every step (`measure` saves no checkpoint)."""
    from omni_core.recipe import Recipe

    plan = case.parallel_plan
    backend = "nccl" if at.device == "cuda" else "auto"
    return Recipe.model_validate(
        {
            "experiment": {"name": f"val-{case.mix}-s{case.seq_len}", "output_dir": str(root), "seed": 0},
            "data": {
                "synthetic": {"num_samples": 400, "mix": MIXES[case.mix]},
                "seq_len": case.seq_len,
                "micro_batch": case.micro_batch,
                "path": str(root / "data" / f"{case.mix}"),
            },
            "model": {"flavor": case.flavor},
            "parallel": {"nproc": plan.world_size, "backend": backend, **plan.recipe_fields()},
            "train": {
                "steps": case.steps,
                "grad_accum": case.grad_accum,
                "warmup_steps": 1,
                "log_every": 1,
                "ckpt_every": 0,
                "resume": False,
                "dtype": at.dtype,
                "ckpt_dir": str(root / "ckpt" / case.name),
            },
        }
    )


def _run_delay() -> float:
    """Seconds this thread has waited for a core since it started (Linux schedstat; 0 elsewhere)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class _StepClock(NullTracker):
    """A tracker that only notes when each step's metrics arrive (log_every=1: once per step): wall clock,
    this process's CPU time, and how long it waited for a core."""

    def __init__(self) -> None:
        self.stamps: dict[str, list[float]] = {"wall_s": [], "cpu_s": [], "delay_s": []}

    def log_metrics(self, metrics, step: int) -> None:
        self.stamps["wall_s"].append(time.perf_counter())
        self.stamps["cpu_s"].append(time.process_time())
        self.stamps["delay_s"].append(_run_delay())


def measure(case: Case, root: Path, info, at: ProbeDevice = CPU_PROBES) -> dict[str, float]:
    """Median per-step seconds of the case on this rank (every rank calls it) after WARMUP steps: on the wall
    clock, in this process's CPU time, and waiting for a core."""
    from omni_core.runtime.trainer import train

    clock = _StepClock()
    train(case_recipe(case, root, at), info, tracker=clock, log=lambda _: None, save=False)
    return {
        key: statistics.mean([b - a for a, b in pairwise(stamps)][WARMUP - 1 :]) for key, stamps in clock.stamps.items()
    }


def _measure_cases(
    rank: int, world: int, root: str, cases: list[Case], repeat: int, at: ProbeDevice = CPU_PROBES
) -> dict[str, dict]:
    """On each rank: every case of this world size in turn, each from a collected heap and right after rank 0
    profiles the device's kernels (`calibrate.profile_compute`: on a CPU in process CPU time, on a GPU on the
    synchronised wall clock; the other ranks wait at a barrier): the host's speed drifts within minutes, so a
    prediction and the run it is compared with are measured seconds apart."""
    import torch

    from omni_core.measure.calibrate import kernel_probes, profile_compute
    from omni_core.runtime.dist import DistInfo, barrier

    device = torch.device("cuda", rank) if at.device == "cuda" else torch.device("cpu")
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=device)
    kernel_clock = at.wall_clock() if at.device == "cuda" else time.process_time
    probes = kernel_probes(at) if rank == 0 else None
    out = {}
    for case in cases:
        # the previous case's model, meshes and graphs sit in reference cycles until a full collection, and the
        # threads of its (destroyed) process groups poll until then: left alive, they slowed the next case by
        # a third (debug dp2 mb2 right after small dp2: 0.34 -> 0.45 s, measured before train() released them)
        gc.collect()
        kernels = profile_compute(repeat, clock=kernel_clock, probes=probes, at=at) if rank == 0 else {}
        barrier()
        out[case.name] = {"kernels": kernels, **measure(case, Path(root), info, at)}
    return out


def validation_cases(quick: bool) -> list[Case]:
    """Plans over world 1-4: DP (FSDP, HSDP), TP, PP (1F1B, interleaved, GPipe), CP (Ulysses, ring), EP and
    their combinations, and the encoders' omni (sharded weights and the joint schedule too) and disaggregated
    layouts beside coupled ones, on the debug, debug-moe and small flavors and four mixes. Quick: 12 short
    cases (5 steps); full: 39, with longer sequences and 10 steps."""
    d, moe, small = "debug", "debug-moe", "small"
    if quick:  # one case per mechanism, short sequences: about a minute and a half on two cores
        cases = [
            Case(d, "dp1", 256, mix="text"),
            Case(small, "dp1", 64),
            Case(d, "dp2", 256),
            Case(d, "dp1-tp2", 256, mix="audio"),
            Case(d, "dp1-pp2v2", 128, grad_accum=4, mix="image"),
            Case(d, "dp1-cp2r", 256, mix="text"),
            Case(moe, "dp2-ep2", 128),
            Case(d, "dp1-pp3", 128, grad_accum=3),
            Case(d, "dp2-pp2", 128, grad_accum=2),
            Case(moe, "dp2-cp2u-ep2", 128),
            Case(d, "dp2+omni", 256, mix="image"),
            Case(d, "dp1+disagg1", 256, mix="image"),
        ]
        return [replace(c, steps=5) for c in cases]
    cases = [
        Case(d, "dp1", 256),
        Case(d, "dp1", 512, mix="text"),
        Case(d, "dp1", 512, mix="image"),
        Case(d, "dp1", 256, grad_accum=2, mix="audio"),
        Case(moe, "dp1", 256),
        Case(small, "dp1", 128),
        Case(d, "dp2", 256),
        Case(d, "dp2x1", 256, mix="text"),
        Case(d, "dp1-tp2", 256),
        Case(d, "dp1-pp2", 256, grad_accum=4),
        Case(d, "dp1-pp2v2", 256, grad_accum=4, mix="image"),
        Case(d, "dp1-pp2g", 256, grad_accum=2, mix="text"),
        Case(d, "dp1-cp2u", 512),
        Case(d, "dp1-cp2r", 512, mix="text"),
        Case(moe, "dp2-ep2", 256),
        Case(moe, "dp1-tp2", 256, mix="text"),
        Case(small, "dp1-tp2", 128, mix="text"),
        Case(small, "dp2", 64, mix="image"),
        Case(d, "dp2", 256, micro_batch=2),
        Case(d, "dp3", 256),
        Case(d, "dp1-pp3", 256, grad_accum=3),
        Case(d, "dp3", 256, micro_batch=2, mix="image"),
        Case(d, "dp4", 256, mix="audio"),
        Case(d, "dp2-tp2", 256),
        Case(d, "dp2-pp2", 256, grad_accum=2),
        Case(d, "dp2x2", 256, mix="image"),
        Case(d, "dp2-cp2r", 512),
        Case(moe, "dp2-cp2u-ep2", 256),
        Case(d, "dp1-tp2-cp2u", 512, mix="text"),
        Case(d, "dp1-pp4g", 256, grad_accum=4),
        Case(d, "dp2+omni", 256, mix="image"),
        Case(d, "dp1-tp2+omni", 256, mix="image"),
        Case(d, "dp1-pp2+omni", 256, grad_accum=4),
        Case(d, "dp2-tp2+omni", 256, mix="image"),
        Case(d, "dp1+disagg1", 256, mix="image"),
        Case(d, "dp2+disagg1", 256, mix="image"),
        Case(d, "dp1-tp2+disagg2", 256, mix="image"),
        Case(d, "dp2+omni.v-fsdp.a-fsdp", 256, mix="image"),
        Case(d, "dp1-pp2+omni-joint", 256, grad_accum=4, mix="image"),
    ]
    return [replace(c, steps=10) for c in cases]


def gpu_validation_cases(gpus: int, quick: bool) -> list[Case]:
    """A dozen plans on one GPU (debug, small, debug-moe and debug-enc flavors at 1-4k tokens, micro-batches
    and accumulation, four mixes), and on 2 and 4 GPUs where there are that many: DP (FSDP), TP, PP and the
    encoders' omni and disaggregated layouts. Quick: four one-GPU cases and one per world size, 6 steps."""
    d, small, moe, enc = "debug", "small", "debug-moe", "debug-enc"
    one = [
        Case(small, "dp1", 2048, mix="text"),
        Case(small, "dp1", 2048, micro_batch=4),
        Case(d, "dp1", 4096),
        Case(moe, "dp1", 2048),
        Case(small, "dp1", 4096, micro_batch=2, mix="image"),
        Case(small, "dp1", 1024, grad_accum=4, mix="audio"),
        Case(d, "dp1", 1024, micro_batch=8, mix="text"),
        Case(enc, "dp1", 2048, mix="image"),
        Case(small, "dp1", 1024, micro_batch=8, mix="mixed"),
        Case(moe, "dp1", 4096, micro_batch=2, mix="text"),
        Case(d, "dp1", 2048, grad_accum=2, mix="audio"),
        Case(small, "dp1", 4096, mix="mixed"),
    ]
    two = [
        Case(small, "dp2", 2048),
        Case(small, "dp1-tp2", 2048, mix="text"),
        Case(small, "dp1-pp2", 2048, grad_accum=4),
        Case(enc, "dp2+omni", 2048, mix="image"),
        Case(enc, "dp1+disagg1", 2048, mix="image"),
    ]
    four = [
        Case(small, "dp4", 2048),
        Case(small, "dp2-tp2", 2048),
        Case(small, "dp1-pp4g", 2048, grad_accum=4),
        Case(enc, "dp2-tp2+omni", 2048, mix="image"),
        Case(enc, "dp4+omni.v-fsdp.a-fsdp", 2048, mix="image"),
    ]
    if quick:
        one, two, four = one[:4], two[:1], four[:1]
    cases = one + two * (gpus >= 2) + four * (gpus >= 4)
    return [replace(c, steps=6 if quick else 10) for c in cases]


class CaseResult(Result):
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
    device: str
    rows: list[CaseResult]
    rounds: int
    mape_pct: float
    mape_pct_by_world: dict[str, float]
    # how much the host itself moves: the mean over cases of (max - min) / median across rounds (None: 1 round)
    measured_spread_pct: float | None
    predicted_spread_pct: float | None
    calibration: list[dict]  # each round's kernels (per case) and its links and wrapper costs
    seconds: float


def predict(case: Case, profile, spec: GpuSpec, eff: Efficiency, *, loader_s: float = 0.0, precision: str = "fp32"):
    """The cost model's Estimate for the case: its plan on the calibrated device (one node of `world`
    ranks) at the `precision` it trains in, its encoders where the plan puts them, plus `loader_s` of host
    data path per micro-batch on every rank."""
    from omni_core.models.flavors import get_flavor

    recipe_data = case_recipe(case, Path("/nonexistent")).data
    args = get_flavor(case.flavor, patch_size=recipe_data.patch_size, n_mels=recipe_data.n_mels)
    workload = omni_workload(
        args, seq_len=case.seq_len, global_batch=case.global_batch, profile=profile, precision=precision, name=case.name
    )
    eff = replace(runtime_efficiency(eff), step_overhead_s=loader_s * case.grad_accum)
    options = Options(micro_batch=case.micro_batch)
    return estimate_step(workload, spec, case.parallel_plan, options, gpus_per_node=case.world, eff=eff)


def _profile(case: Case, root: Path):
    from omni_core.data.profile import profile_dataset

    return profile_dataset(case_recipe(case, root), root / "profiles" / f"{case.mix}-s{case.seq_len}")[0]


def loader_seconds(case: Case, root: Path, batches: int = 8) -> float:
    """Host data path: median seconds for the runtime's loader to read, decode and pack one micro-batch of
    this case's data (measured alone, before any training step)."""
    from omni_core.data.dataset import open_dataset
    from omni_core.data.loader import PackedLoader

    recipe = case_recipe(case, root)
    loader = iter(PackedLoader(open_dataset(recipe), recipe.data, "train", 0, 1, 0))
    next(loader)
    times = []
    for _ in range(batches):
        start = time.process_time()
        next(loader)
        times.append(time.process_time() - start)
    return statistics.median(times)


def _spread(values: list[float]) -> float:
    return 100 * (max(values) - min(values)) / statistics.median(values)


def validate(
    cases: list[Case], root: Path, device: GpuSpec, *, rounds: int = 3, repeat: int = 5, at: ProbeDevice = CPU_PROBES
) -> ValidationReport:
    """Measure every case on the real runtime and predict each from a calibration of the device: its kernels
    profiled right before the case's run (`calibrate.profile_compute`, in the launched rank 0), links and the
    runtime's wrappers on two ranks once per round (`calibrate.profile_ranks`); report the errors.

    A shared host's speed drifts by tens of percent within seconds and minutes, and the calibration's probes
    drift with it. So the whole is done in `rounds` rounds (one launch per world size running all of its
    cases): a case's prediction is the mean of its rounds' predictions (each from its own calibration,
    whose fitted terms compensate each other) and its measurement the mean of its rounds' means (the host
    switches between a fast and a slow state within a second, and a run's time is what it averages to, as
    in `calibrate._sample`); the spread across rounds is reported."""
    from omni_core.measure.calibrate import profile_links, profile_ranks, with_compute, with_links, with_ranks

    started = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    profiles, loaders = {}, {}
    for case in cases:  # profiles (and the synthetic data) first, so no measured step pays for generation
        key = (case.mix, case.seq_len)
        if key not in profiles:
            profiles[key] = _profile(case, root)
        if (*key, case.micro_batch) not in loaders:
            loaders[(*key, case.micro_batch)] = loader_seconds(case, root)
    gpu = at.device == "cuda"
    link_world = 2 if not gpu else max(c.world for c in cases)  # CPU: the ranks probe's two cores
    multi_rank = any(c.world > 1 for c in cases)
    estimates: dict[str, list] = {c.name: [] for c in cases}
    measured: dict[str, list[dict[str, float]]] = {c.name: [] for c in cases}
    calibrations = []
    for _ in range(rounds):
        ranks = None
        if multi_rank:
            ranks = profile_links(link_world, repeat, at) if gpu else profile_ranks(link_world, repeat)
        kernels, links = {}, {}
        for world in sorted({c.world for c in cases}):
            batch = [c for c in cases if c.world == world]
            results = run_ranks(_measure_cases, world, str(root), batch, repeat, at, backend="nccl" if gpu else "gloo")[
                0
            ]
            for case in batch:
                real = results[case.name]
                kernels[case.name] = real.pop("kernels")
                host = device if gpu else replace(device, cores=os.cpu_count() or 1)
                spec, eff = with_compute(host, kernels[case.name], at)
                if case.world > 1 and gpu:
                    spec, eff, fits = with_links(spec, eff, ranks["collectives"], link_world)
                    links = {"collectives": {k: {"alpha_s": a, "beta_bytes_s": b} for k, (a, b) in fits.items()}}
                elif case.world > 1:
                    spec, eff, links = with_ranks(spec, eff, ranks, link_world)
                estimates[case.name].append(
                    predict(
                        case,
                        profiles[(case.mix, case.seq_len)],
                        spec,
                        eff,
                        loader_s=loaders[(case.mix, case.seq_len, case.micro_batch)],
                        precision=at.precision,
                    )
                )
                measured[case.name].append(real)
        calibrations.append({"kernels": kernels, "ranks": links})
    return _report(cases, estimates, measured, calibrations, device.name, rounds, started)


def _report(
    cases: list[Case],
    estimates: dict[str, list],
    measured: dict[str, list[dict[str, float]]],
    calibrations: list[dict],
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


CASE_TAIL = re.compile(r"-s(\d+)-mb(\d+)-ga(\d+)-(\w+)$")


def repredict(rows: list[CaseResult], calibrations: list[dict], root: Path, device: GpuSpec) -> ValidationReport:
    """A stored CPU validation's measurements predicted again by this checkout's cost model, from the
    report's own calibrations (each case's kernels, each round's links and wrappers) and loader seconds (its
    `host_s` term): a model change compared on the same measurements, free of the host's drift between runs
    (`measured_spread_pct`: tens of percent here, as wide as the changes to be judged)."""
    from omni_core.measure.calibrate import with_compute, with_ranks_summary

    if any(c["ranks"] and "wrappers" not in c["ranks"] for c in calibrations):
        raise ValueError("re-prediction reads CPU validation reports: these calibrations hold a GPU's NCCL links")
    started = time.perf_counter()
    host = replace(device, cores=os.cpu_count() or 1)
    cases, profiles = [], {}
    estimates: dict[str, list] = {}
    measured: dict[str, list[dict[str, float]]] = {}
    for row in rows:
        tail = CASE_TAIL.search(row.case)
        if tail is None or not row.case.startswith(f"{row.flavor}-{row.plan}-"):
            raise ValueError(f"validation row {row.case!r}: not a case name (flavor-plan-sN-mbN-gaN-mix)")
        seq_len, micro_batch, grad_accum = (int(g) for g in tail.groups()[:3])
        case = Case(row.flavor, row.plan, seq_len, micro_batch, grad_accum, tail.group(4))
        if case.mix not in MIXES:
            raise ValueError(f"validation row {row.case!r}: unknown mix {case.mix!r} (known: {', '.join(MIXES)})")
        if any(row.case not in calibration["kernels"] for calibration in calibrations):
            raise ValueError(f"validation row {row.case!r}: a round's calibration holds no kernels for it")
        cases.append(case)
        key = (case.mix, case.seq_len)
        if key not in profiles:
            profiles[key] = _profile(case, root)
        loader_s = row.breakdown["host_s"] / case.grad_accum  # the step's host data path: a micro-batch's each
        estimates[case.name] = []
        for calibration in calibrations:
            spec, eff = with_compute(host, calibration["kernels"][row.case])
            if case.world > 1:
                spec, eff = with_ranks_summary(spec, eff, calibration["ranks"], 2)  # the ranks probe's two cores
            estimates[case.name].append(predict(case, profiles[key], spec, eff, loader_s=loader_s))
        measured[case.name] = [
            {"wall_s": wall, "cpu_s": row.measured_cpu_s, "delay_s": row.waited_s} for wall in row.measured_rounds_s
        ]
    return _report(cases, estimates, measured, calibrations, device.name, len(calibrations), started)


def calibrate_and_validate(quick: bool, root: Path, device: str = "cpu") -> ValidationReport:
    """Validate `validation_cases(quick)` on this host as `device` (quick: 1 round of 1 probe repeat, to stay
    within two minutes; full: 3 rounds of 3)."""
    from omni_core.common.catalog import GpuCatalog

    return validate(
        validation_cases(quick), root, GpuCatalog()[device], rounds=1 if quick else 3, repeat=1 if quick else 3
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
