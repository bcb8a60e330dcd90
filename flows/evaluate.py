"""Evaluate stage: held-out quality of the newest checkpoint, overall and per modality."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from flows import resolve, stage_dir
from omni_core.common.results import EvalReport
from omni_core.recipe import Recipe
from omni_core.runtime.evaluate import evaluate_checkpoint
from omni_core.tracking import stage_run


def eval_metrics(report: EvalReport) -> dict[str, float]:
    metrics = {"eval/loss": report.loss, "eval/perplexity": report.perplexity}
    for modality, score in report.per_modality.items():
        metrics[f"eval/{modality}/loss"] = score.loss
        metrics[f"eval/{modality}/perplexity"] = score.perplexity
    for modality, task in report.task.items():
        metrics[f"eval/{modality}/word_accuracy"] = task.word_accuracy
        metrics[f"eval/{modality}/exact_match"] = task.exact_match
        metrics[f"eval/{modality}/answer_exact_match"] = task.answer_exact_match
        metrics[f"eval/{modality}/answer_token_f1"] = task.answer_token_f1
    return metrics


def eval_chart(report: EvalReport, path: Path) -> Path:
    """Held-out loss per modality, and word accuracy of greedy captions/transcripts per modality."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(8, 3.2), layout="constrained")
    loss_ax, task_ax = fig.subplots(1, 2)
    names = list(report.per_modality)
    bars = loss_ax.bar(names, [report.per_modality[m].loss for m in names], color="tab:blue")
    loss_ax.bar_label(bars, fmt="%.3f")
    loss_ax.axhline(report.loss, color="tab:red", linestyle="--", label=f"all: {report.loss:.3f}")
    loss_ax.set_ylabel("held-out loss")
    loss_ax.set_title(f"eval loss by modality (step {report.step})")
    loss_ax.legend()
    tasks = list(report.task)
    bars = task_ax.bar(tasks, [report.task[m].word_accuracy for m in tasks], color="tab:green")
    task_ax.bar_label(bars, labels=[f"{report.task[m].word_accuracy:.2f} (n={report.task[m].samples})" for m in tasks])
    task_ax.set_ylim(0, 1.05)
    task_ax.set_ylabel("word accuracy")
    task_ax.set_title("greedy captions / transcripts")
    fig.savefig(path, dpi=120)
    return path


@flow(name="evaluate")
def evaluate_flow(
    recipe: Recipe | str, overrides: list[str] | None = None, checkpoint: str | None = None
) -> EvalReport:
    """Evaluate `checkpoint` (the train stage's: its plan may have its own micro-batches, hence its own
    checkpoint directory), else the recipe's newest complete one; log eval_report.json, eval/* metrics (loss,
    perplexity and word accuracy of greedy captions per modality) and a chart of both."""
    r = resolve(recipe, overrides)
    with stage_run("evaluate", r, flow_run_id=flow_run.id) as run:
        report = evaluate_checkpoint(r, checkpoint)
        run.log_dict(report.model_dump(mode="json"), "eval_report.json")
        run.log_metrics(eval_metrics(report), step=report.step)
        run.log_artifact(eval_chart(report, stage_dir(r, run.run_id) / "eval_by_modality.png"))
        return report
