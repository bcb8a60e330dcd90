"""Evaluate stage: held-out quality of the newest checkpoint, overall and per modality."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from flows import stage_dir
from omni_core.recipe import load_recipe
from omni_core.results import EvalReport
from omni_core.runtime.evaluate import evaluate
from omni_core.tracking import stage_run


def eval_metrics(report: EvalReport) -> dict[str, float]:
    metrics = {"eval/loss": report.loss, "eval/perplexity": report.perplexity}
    for modality, score in report.per_modality.items():
        metrics[f"eval/{modality}/loss"] = score.loss
        metrics[f"eval/{modality}/perplexity"] = score.perplexity
    return metrics


def loss_bar_chart(report: EvalReport, path: Path) -> Path:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    names = list(report.per_modality)
    fig = Figure(figsize=(4.5, 3.2), layout="constrained")
    ax = fig.add_subplot()
    bars = ax.bar(names, [report.per_modality[m].loss for m in names], color="tab:blue")
    ax.bar_label(bars, fmt="%.3f")
    ax.axhline(report.loss, color="tab:red", linestyle="--", label=f"all: {report.loss:.3f}")
    ax.set_ylabel("held-out loss")
    ax.set_title(f"eval loss by modality (step {report.step})")
    ax.legend()
    fig.savefig(path, dpi=120)
    return path


@flow(name="evaluate")
def evaluate_flow(recipe: str, overrides: list[str] | None = None) -> EvalReport:
    """Evaluate the newest complete checkpoint; log eval_report.json, eval/* metrics and a per-modality chart."""
    r = load_recipe(recipe, overrides or ())
    with stage_run("evaluate", r, flow_run_id=flow_run.id) as run:
        report = evaluate(r)
        run.log_dict(report.model_dump(mode="json"), "eval_report.json")
        run.log_metrics(eval_metrics(report), step=report.step)
        run.log_artifact(loss_bar_chart(report, stage_dir(r, run.run_id) / "eval_loss_by_modality.png"))
        return report
