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
`probe_device.CUDA_PROBES`, `cases.gpu_validation_cases`) the same runs are spawned NCCL ranks, one per GPU,
training in bf16; the kernels are profiled on the GPU and the links by NCCL collectives among the case's GPUs.

This module runs the rounds and re-predicts stored reports; the cases are `cases`, their runs `case_runs`,
their predictions `case_prediction` and the report `validation_report`.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_core.common.catalog import GpuSpec
from omni_core.estimator.cost import Efficiency, Estimate
from omni_core.measure.case_prediction import data_profile, loader_seconds, predict
from omni_core.measure.case_runs import measure_cases
from omni_core.measure.cases import MIXES, Case, validation_cases
from omni_core.measure.collective_probes import profile_links
from omni_core.measure.measured_efficiency import with_compute, with_links, with_ranks, with_ranks_summary
from omni_core.measure.probe_device import CPU_PROBES, ProbeDevice
from omni_core.measure.rank_probes import profile_ranks
from omni_core.measure.validation_report import CaseResult, ValidationReport, build_report
from omni_core.runtime.ranks import run_ranks

if TYPE_CHECKING:
    from omni_core.data.profile_result import DatasetProfile


def validate(
    cases: list[Case], root: Path, device: GpuSpec, *, rounds: int = 3, repeat: int = 5, at: ProbeDevice = CPU_PROBES
) -> ValidationReport:
    """Measure every case on the real runtime and predict each from a calibration of the device: its kernels
    profiled right before the case's run (`kernels.profile_compute`, in the launched rank 0), links and the
    runtime's wrappers on two ranks once per round (`rank_probes.profile_ranks`); report the errors.

    A shared host's speed drifts by tens of percent within seconds and minutes, and the calibration's probes
    drift with it. So the whole is done in `rounds` rounds (one launch per world size running all of its
    cases): a case's prediction is the mean of its rounds' predictions (each from its own calibration,
    whose fitted terms compensate each other) and its measurement the mean of its rounds' means (the host
    switches between a fast and a slow state within a second, and a run's time is what it averages to, as
    in `sampling.sample`); the spread across rounds is reported."""
    started = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    profiles, loaders = _case_inputs(cases, root)
    gpu = at.device == "cuda"
    link_world = 2 if not gpu else max(c.world for c in cases)  # CPU: the ranks probe's two cores
    multi_rank = any(c.world > 1 for c in cases)
    estimates: dict[str, list[Estimate]] = {c.name: [] for c in cases}
    measured: dict[str, list[dict[str, float]]] = {c.name: [] for c in cases}
    calibrations: list[dict[str, Any]] = []
    for _ in range(rounds):
        ranks = None
        if multi_rank:
            ranks = profile_links(link_world, repeat, at) if gpu else profile_ranks(link_world, repeat)
        kernels: dict[str, dict[str, float]] = {}
        links: dict[str, Any] = {}
        for world in sorted({c.world for c in cases}):
            batch = [c for c in cases if c.world == world]
            backend = "nccl" if gpu else "gloo"
            results = run_ranks(measure_cases, world, str(root), batch, repeat, at, backend=backend)[0]
            for case in batch:
                real = results[case.name]
                kernels[case.name] = real.pop("kernels")
                spec, eff, case_links = _calibration(case, device, kernels[case.name], ranks, link_world, at)
                if case.world > 1:
                    links = case_links
                key = (case.mix, case.seq_len)
                estimates[case.name].append(
                    predict(
                        case,
                        profiles[key],
                        spec,
                        eff,
                        loader_s=loaders[(*key, case.micro_batch)],
                        precision=at.precision,
                    )
                )
                measured[case.name].append(real)
        calibrations.append({"kernels": kernels, "ranks": links})
    return build_report(cases, estimates, measured, calibrations, device.name, rounds, started)


def _case_inputs(
    cases: list[Case], root: Path
) -> tuple[dict[tuple[str, int], DatasetProfile], dict[tuple[str, int, int], float]]:
    """The data profile per (mix, sequence length) and the loader's seconds per (mix, sequence length,
    micro-batch), made before any case runs, so that no measured step pays for generating the synthetic data."""
    profiles: dict[tuple[str, int], DatasetProfile] = {}
    loaders: dict[tuple[str, int, int], float] = {}
    for case in cases:
        key = (case.mix, case.seq_len)
        if key not in profiles:
            profiles[key] = data_profile(case, root)
        if (*key, case.micro_batch) not in loaders:
            loaders[(*key, case.micro_batch)] = loader_seconds(case, root)
    return profiles, loaders


def _calibration(
    case: Case,
    device: GpuSpec,
    kernels: dict[str, float],
    ranks: dict[str, Any] | None,
    link_world: int,
    at: ProbeDevice,
) -> tuple[GpuSpec, Efficiency, dict[str, Any]]:
    """The device calibrated for a case: the kernels rank 0 profiled right before it (on a CPU host, with this
    host's cores), and for several ranks the round's links (and on CPUs the runtime's wrappers), with their
    summary as the report stores it ({} for one rank)."""
    gpu = at.device == "cuda"
    spec, eff = with_compute(at.host(device), kernels, at)
    if case.world == 1:
        return spec, eff, {}
    assert ranks is not None, "a round with cases of several ranks probes the ranks first"
    if gpu:
        spec, eff, fits = with_links(spec, eff, ranks["collectives"], link_world)
        return spec, eff, {"collectives": {k: {"alpha_s": a, "beta_bytes_s": b} for k, (a, b) in fits.items()}}
    return with_ranks(spec, eff, ranks, link_world)


CASE_TAIL = re.compile(r"-s(\d+)-mb(\d+)-ga(\d+)-(\w+)$")


def repredict(
    rows: list[CaseResult], calibrations: list[dict[str, Any]], root: Path, device: GpuSpec
) -> ValidationReport:
    """A stored CPU validation's measurements predicted again by this checkout's cost model, from the
    report's own calibrations (each case's kernels, each round's links and wrappers) and loader seconds (its
    `host_s` term): a model change compared on the same measurements, free of the host's drift between runs
    (`measured_spread_pct`: as wide as the changes to be judged)."""
    if any(c["ranks"] and "wrappers" not in c["ranks"] for c in calibrations):
        raise ValueError("re-prediction reads CPU validation reports: these calibrations hold a GPU's NCCL links")
    started = time.perf_counter()
    host = CPU_PROBES.host(device)
    cases: list[Case] = []
    profiles: dict[tuple[str, int], DatasetProfile] = {}
    estimates: dict[str, list[Estimate]] = {}
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
            profiles[key] = data_profile(case, root)
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
    return build_report(cases, estimates, measured, calibrations, device.name, len(calibrations), started)


def calibrate_and_validate(quick: bool, root: Path, device: str = "cpu") -> ValidationReport:
    """Validate `validation_cases(quick)` on this host as `device` (quick: 1 round of 1 probe repeat, to stay
    within two minutes; full: 3 rounds of 3)."""
    from omni_core.common.catalog import GpuCatalog

    return validate(
        validation_cases(quick), root, GpuCatalog()[device], rounds=1 if quick else 3, repeat=1 if quick else 3
    )
