"""What a study shows: the side-by-side table, figures (throughput and utilisation over time, a Gantt
chart of a window), and the files and metrics that go to MLflow. Every figure's title names the jobs the
oracle could not model and the malformed trace rows, so no figure hides them. The table shows per policy
the jobs finished and those it could never admit, both throughput averages, over every round and over busy
rounds (the Crius artifact's), each also as a ratio to FCFS, so a study compares to the artifact's figures
as well as to omni's own, mean and p95 JCT, queueing and decision times."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from omni_core.scheduler.simulator import Metrics, SchedulePlan

COLUMNS = (
    "jobs_finished",
    "never_admitted",
    "mean_throughput",
    "busy_throughput",
    "mean_jct_s",
    "p95_jct_s",
    "p99_jct_s",
    "makespan_s",
    "mean_queueing_s",
    "p95_decision_s",
    "max_decision_s",
    "wall_s",
    "cpu_s",
)
GANTT_WINDOW_S = 24 * 3600.0
GANTT_MAX_JOBS = 60


def summary(m: Metrics) -> dict[str, float | int | None]:
    """The benchmark's per-policy row (times in seconds, JCT and queueing also in hours)."""
    row = {k: getattr(m, k) for k in COLUMNS}
    for key in ("mean_jct", "p95_jct", "mean_queueing"):
        row[f"{key}_h"] = None if row[f"{key}_s"] is None else row[f"{key}_s"] / 3600
    return row


def caveat(plan: SchedulePlan) -> str:
    m = plan.metrics
    return (
        f"{m.jobs} jobs ({m.arrived} arrived by the horizon), {m.unmodelled} not modelled (never run), "
        f"{m.trace_issues} malformed trace rows"
    )


def format_table(plans: Mapping[str, SchedulePlan]) -> str:
    if not plans:
        return "(no policies)"
    first = next(iter(plans.values()))
    header = (
        f"{'policy':12} {'finished':>8} {'never adm':>9} {'tput/s':>10} {'x fcfs':>7} {'busy tput/s':>11} "
        f"{'x fcfs':>7} {'mean JCT h':>10} {'p95 JCT h':>10} {'queue h':>7} {'util':>5} {'resched':>7} "
        f"{'p95 dec s':>9} {'max dec s':>9} {'cpu s':>7}"
    )
    lines = [f"{first.trace}: {caveat(first)}; {first.metrics.rounds} rounds of {first.round_s:g} s", header]
    fcfs = plans["fcfs"].metrics if "fcfs" in plans else None
    fcfs_tput, fcfs_busy = (fcfs.mean_throughput, fcfs.busy_throughput) if fcfs is not None else (None, None)

    def ratio(x: float, base: float | None) -> str:
        return f"{x / base:.2f}" if base else "-"

    def hours(x: float | None) -> str:
        return "-" if x is None else f"{x / 3600:.1f}"

    for name, p in plans.items():
        m = p.metrics
        lines.append(
            f"{name:12} {m.jobs_finished:8d} {m.never_admitted:9d} {m.mean_throughput:10.1f} "
            f"{ratio(m.mean_throughput, fcfs_tput):>7} {m.busy_throughput:11.1f} "
            f"{ratio(m.busy_throughput, fcfs_busy):>7} {hours(m.mean_jct_s):>10} "
            f"{hours(m.p95_jct_s):>10} {hours(m.mean_queueing_s):>7} {m.mean_utilisation:5.2f} "
            f"{m.reschedules_per_job:7.2f} {m.p95_decision_s:9.3f} {m.max_decision_s:9.3f} {m.cpu_s:7.1f}"
        )
    return "\n".join(lines)


def write_figures(plans: Mapping[str, SchedulePlan], out_dir: str | Path) -> list[Path]:
    """throughput.png / utilisation.png (all policies over time) and gantt_<policy>.png (the first day)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not plans:
        return []
    note = caveat(next(iter(plans.values())))
    paths = []
    for key, label in (("throughput", "cluster throughput (samples/s)"), ("utilisation", "GPUs held (share)")):
        fig = Figure(figsize=(8, 3.5))
        ax = fig.add_subplot()
        for name, p in plans.items():
            ax.plot([t / 3600 for t in p.series["t_s"]], p.series[key], label=name, linewidth=0.8)
        ax.set(xlabel="hours", ylabel=label, title=f"{label}\n{note}")
        ax.title.set_fontsize(8)
        ax.legend(fontsize=7)
        paths.append(_save(fig, out_dir / f"{key}.png", FigureCanvasAgg))
    colours = {"a100": "tab:red", "v100": "tab:blue", "a40": "tab:green", "a10": "tab:orange"}
    for name, p in plans.items():
        t0 = p.jobs[0].arrival_s if p.jobs else 0.0  # jobs are in arrival order; the series starts there too
        shown = [s for s in p.segments if s.start_s - t0 < GANTT_WINDOW_S]
        jobs = sorted({s.job for s in shown}, key=lambda j: min(s.start_s for s in shown if s.job == j))[
            :GANTT_MAX_JOBS
        ]
        row = {j: i for i, j in enumerate(jobs)}
        fig = Figure(figsize=(8, 0.12 * len(jobs) + 1.5))
        ax = fig.add_subplot()
        for s in shown:
            if s.job in row:
                ax.barh(
                    row[s.job],
                    (s.end_s - s.start_s) / 3600,
                    left=(s.start_s - t0) / 3600,
                    height=0.8,
                    color=colours.get(s.gpu_type, "tab:gray"),
                    linewidth=0,
                )
        ax.set(
            xlabel="hours",
            ylabel="job",
            yticks=[],
            title=f"{name}: first {len(jobs)} jobs started in the first {GANTT_WINDOW_S / 3600:.0f} h "
            f"(colour = GPU type)\n{note}",
        )
        ax.title.set_fontsize(8)
        paths.append(_save(fig, out_dir / f"gantt_{name}.png", FigureCanvasAgg))
    return paths


def _save(fig, path: Path, canvas) -> Path:
    canvas(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def save_study(plans: Mapping[str, SchedulePlan], out_dir: str | Path) -> Path:
    """schedule_<policy>.json per policy, the figures and summary.txt into out_dir."""
    out_dir = Path(out_dir)
    for name, p in plans.items():
        p.save(out_dir / f"schedule_{name}.json")
    write_figures(plans, out_dir)
    (out_dir / "summary.txt").write_text(format_table(plans) + "\n")
    return out_dir


def log_study(plans: Mapping[str, SchedulePlan], recipe, out_dir: str | Path, run_name: str = "simulate") -> str:
    """One MLflow run holding the study's files and each policy's headline metrics; returns its id."""
    from omni_core.tracking import stage_run

    save_study(plans, out_dir)
    with stage_run(run_name, recipe, flow_run_id="") as run:
        for name, p in plans.items():
            numbers = {f"sim/{name}/{k}": v for k, v in p.metrics.model_dump().items() if isinstance(v, (int, float))}
            run.log_metrics(numbers, step=0)
        run.log_artifacts(out_dir)
        return run.run_id
