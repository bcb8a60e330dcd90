"""Trace readers (Crius, ITP raw, Philly) and the seeded mapping from raw traces to model jobs.

Every malformed row (missing or non-numeric field, negative duration or count, unknown GPU type) becomes a
`TraceIssue` naming the file and line; rows are never dropped silently, and studies report the count.

Raw traces (ITP, Philly) only carry arrival, duration and GPU count. `map_raw_jobs` turns them into model
jobs the way the Crius authors built their trace from ITP cluster08, with one seeded generator so a study
is reproducible:
  1. keep each raw job with probability `keep` (the Crius trace kept 1,938 of cluster08's 13,047);
  2. draw the model and global batch from the Crius trace's mix (MODEL_MIX, BATCH_MIX below) and the
     requested GPU type uniformly over the cluster's types;
  3. request the raw GPU count rounded up to a power of two, raised until the model fits memory on that
     type (a new type is drawn, up to 8 times, when it fits nowhere there), capped at `max_gpus`;
  4. set iterations so that the job runs for its raw duration on the requested GPUs with the best plan.
Arrivals are shifted so the first kept job arrives at 0.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import numpy as np

from omni_core.scheduler.jobs import Job, ThroughputTable

TraceFormat = Literal["crius", "itp", "philly"]
HEADERS: dict[TraceFormat, tuple[str, ...]] = {
    "crius": (
        "job_id",
        "submission_time",
        "num_iteration",
        "model_name",
        "deadline",
        "batch_size",
        "num_gpu",
        "gpu_type",
    ),
    "itp": ("job_id", "submission_time", "duration", "num_gpu"),
    "philly": ("timestamp", "duration", "num_gpus", "gpu_time", "cluster"),
}
# Model and batch mix of the Crius artifact's trace (traces/crius, job counts per value).
MODEL_MIX = {
    "moe__2.4B": 454,
    "moe__1.3B": 331,
    "moe__690M": 237,
    "moe__10B": 207,
    "bert__1.3B": 154,
    "bert__2.6B": 138,
    "bert__760M": 120,
    "wide_resnet__2B": 99,
    "wide_resnet__1B": 55,
    "wide_resnet__4B": 46,
    "wide_resnet__500M": 39,
    "bert__6.7B": 38,
    "wide_resnet__6.8B": 18,
    "moe__27B": 2,
}
BATCH_MIX = {256: 1264, 128: 351, 512: 251, 1024: 72}


@dataclass(frozen=True)
class TraceIssue:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass(frozen=True)
class RawJob:
    id: str
    arrival_s: float
    duration_s: float
    num_gpus: int


@dataclass
class Trace:
    path: str
    format: TraceFormat
    jobs: list[Job] = field(default_factory=list)
    issues: list[TraceIssue] = field(default_factory=list)
    rows: int = 0


def detect_format(path: str | Path) -> TraceFormat:
    with open(path, newline="") as f:
        header = tuple(next(csv.reader(f), ()))
    for name, columns in HEADERS.items():
        if header == columns:
            return name
    raise ValueError(f"{path}:1: unknown trace header {','.join(header)!r} (expected one of {list(HEADERS)})")


class _RowError(ValueError):
    pass


def _field(row: dict[str, str], name: str) -> str:
    value = row.get(name)
    if value is None or value.strip() == "":
        raise _RowError(f"missing {name}")
    return value.strip()


def _number(row: dict[str, str], name: str, *, integer: bool = False, minimum: float = 0.0) -> float:
    text = _field(row, name)
    try:
        value = float(text)
    except ValueError:
        raise _RowError(f"{name}={text!r} is not a number") from None
    if not math.isfinite(value) or (integer and not value.is_integer()):
        raise _RowError(f"{name}={text!r} is not {'an integer' if integer else 'a finite number'}")
    if value < minimum:
        raise _RowError(f"{name}={text} is {'negative' if value < 0 else f'below {minimum:g}'}")
    return value


def _rows(path: str | Path, fmt: TraceFormat):
    """(line number, row dict) per data row, after checking the header."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != HEADERS[fmt]:
            raise ValueError(f"{path}:1: header {reader.fieldnames} is not the {fmt} header {list(HEADERS[fmt])}")
        for row in reader:
            yield reader.line_num, row


def read_crius(path: str | Path, gpu_types: set[str], type_names: Mapping[str, str] | None = None) -> Trace:
    """The Crius artifact's trace: jobs with model, batch, iterations, deadline and requested GPUs; a GPU type
    named in `type_names` (trace name -> cluster type, lower case) is requested as that cluster type."""
    names = {k.lower(): v for k, v in (type_names or {}).items()}
    trace = Trace(str(path), "crius")
    for line, row in _rows(path, "crius"):
        trace.rows += 1
        try:
            if None in row:
                raise _RowError("too many fields")
            gpu_type = _field(row, "gpu_type").lower()
            gpu_type = names.get(gpu_type, gpu_type)
            if gpu_type not in gpu_types:
                raise _RowError(f"unknown GPU type {gpu_type!r} (cluster has {sorted(gpu_types)})")
            arrival = _number(row, "submission_time")
            trace.jobs.append(
                Job(
                    id=_field(row, "job_id"),
                    model=_field(row, "model_name"),
                    global_batch=int(_number(row, "batch_size", integer=True, minimum=1)),
                    iterations=int(_number(row, "num_iteration", integer=True, minimum=1)),
                    arrival_s=arrival,
                    deadline_s=_number(row, "deadline", minimum=arrival),
                    gpu_type=gpu_type,
                    num_gpus=int(_number(row, "num_gpu", integer=True, minimum=1)),
                )
            )
        except _RowError as e:
            trace.issues.append(TraceIssue(str(path), line, str(e)))
    return _rebase(trace)


def read_raw(path: str | Path, fmt: Literal["itp", "philly"]) -> tuple[list[RawJob], list[TraceIssue], int]:
    """Arrival, duration and GPU count of each row of an ITP or Philly trace (times in seconds)."""
    jobs: list[RawJob] = []
    issues: list[TraceIssue] = []
    rows = 0
    gpus, start = ("num_gpu", "submission_time") if fmt == "itp" else ("num_gpus", "timestamp")
    for line, row in _rows(path, fmt):
        rows += 1
        try:
            if None in row:
                raise _RowError("too many fields")
            if fmt == "itp":
                arrival, job_id = _number(row, start), _field(row, "job_id")
            else:
                text = _field(row, start)
                try:
                    arrival = datetime.strptime(text, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
                except ValueError:
                    raise _RowError(f"timestamp={text!r} is not YYYY-MM-DD HH:MM:SS") from None
                job_id = f"philly-{line}"
            duration = _number(row, "duration")
            jobs.append(RawJob(job_id, arrival, duration, int(_number(row, gpus, integer=True, minimum=1))))
        except _RowError as e:
            issues.append(TraceIssue(str(path), line, str(e)))
    return jobs, issues, rows


def map_raw_jobs(
    raw: list[RawJob], table: ThroughputTable, *, seed: int, keep: float = 1.0, max_gpus: int = 32
) -> list[Job]:
    """Model jobs from raw (arrival, duration, GPU count) rows; see the module docstring for the recipe."""
    rows = sorted(raw, key=lambda r: (r.arrival_s, r.id))
    rng = np.random.default_rng(seed)
    # Every row gets its draws up front, so neither `keep` nor the oracle's answers shift later rows' draws.
    kept = rng.random(len(rows)) < keep
    model_of = rng.choice(list(MODEL_MIX), size=len(rows), p=_shares(MODEL_MIX))
    batch_of = rng.choice(list(BATCH_MIX), size=len(rows), p=_shares(BATCH_MIX))
    types_of = rng.integers(len(table.gpu_types), size=(len(rows), 8))
    counts = [n for n in table.counts if n <= max_gpus]
    jobs: list[Job] = []
    for r, model, batch, type_draws in zip(
        np.array(rows, dtype=object)[kept], model_of[kept], batch_of[kept], types_of[kept]
    ):
        want = min(1 << (r.num_gpus - 1).bit_length(), counts[-1])
        probe = Job(r.id, str(model), int(batch), 1, r.arrival_s)
        gpu_type, n, rate = table.gpu_types[type_draws[0]], want, float("nan")  # unmodelled: the user's request
        if table.modelled(probe):
            for t in type_draws:
                rates = table.rates(probe)[t]
                fits = [c for c, m in enumerate(table.counts) if m in counts and m >= want and np.isfinite(rates[c])]
                if fits:
                    gpu_type, n, rate = table.gpu_types[t], table.counts[fits[0]], float(rates[fits[0]])
                    break
        iterations = max(1, round(r.duration_s * rate / int(batch))) if np.isfinite(rate) else 1  # 1: never runs
        jobs.append(Job(r.id, str(model), int(batch), iterations, r.arrival_s, None, gpu_type, n))
    return _shift(jobs)


def _shares(mix: dict) -> np.ndarray:
    weights = np.array(list(mix.values()), dtype=float)
    return weights / weights.sum()


def _shift(jobs: list[Job]) -> list[Job]:
    if not jobs:
        return jobs
    t0 = min(j.arrival_s for j in jobs)
    return [
        Job(
            j.id,
            j.model,
            j.global_batch,
            j.iterations,
            j.arrival_s - t0,
            None if j.deadline_s is None else j.deadline_s - t0,
            j.gpu_type,
            j.num_gpus,
        )
        for j in jobs
    ]


def _rebase(trace: Trace) -> Trace:
    trace.jobs = _shift(sorted(trace.jobs, key=lambda j: (j.arrival_s, j.id)))
    return trace


def load_trace(
    path: str | Path,
    table: ThroughputTable,
    *,
    fmt: str = "auto",
    seed: int = 0,
    keep: float = 1.0,
    max_gpus: int = 32,
    start_s: float = 0.0,
    gpu_type_names: Mapping[str, str] | None = None,
) -> Trace:
    """Read any of the three formats into model jobs (raw traces through `map_raw_jobs`), replaying from
    `start_s` seconds after the first arrival (the window's first job then arrives at 0). `gpu_type_names`
    maps a Crius trace's GPU type names to the cluster's (`schedule.trace_gpu_types`); raw traces name none,
    so a mapping for one is refused, as is one onto a type the cluster lacks."""
    kind: TraceFormat = detect_format(path) if fmt == "auto" else fmt  # type: ignore[assignment]
    names = dict(gpu_type_names or {})
    unknown = sorted(v for v in names.values() if v not in table.gpu_types)
    if unknown:
        raise ValueError(f"schedule.trace_gpu_types maps onto {unknown}, not the cluster's {list(table.gpu_types)}")
    if names and kind != "crius":
        raise ValueError(f"schedule.trace_gpu_types: the {kind} trace names no GPU types to map")
    if kind == "crius":
        trace = read_crius(path, set(table.gpu_types), names)
    else:
        raw, issues, rows = read_raw(path, kind)
        if raw and start_s:
            first = min(r.arrival_s for r in raw)
            raw = [r for r in raw if r.arrival_s - first >= start_s]
        trace = Trace(str(path), kind, map_raw_jobs(raw, table, seed=seed, keep=keep, max_gpus=max_gpus), issues, rows)
        start_s = 0.0  # mapped jobs are already rebased to the window
    trace.jobs = _shift([j for j in trace.jobs if j.arrival_s >= start_s])
    return trace
