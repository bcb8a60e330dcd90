"""A job re-planned mid-run by its train stage's watcher, on 2 CPU ranks: it stops at a checkpoint, resumes
under the new plan with its data order, finishes every step with the losses of a run that was never
re-planned, and each look is an MLflow run beside the train run."""

from __future__ import annotations

import pytest

from tests.helpers.recipes import write_recipe

# text alone for five steps, then mostly images: the look at step 5 sees the drift
REPLAN_FLOW = {
    "experiment.name": "replan-flow", "experiment.seed": 0,
    "data.source": "dynamic", "data.seq_len": 384, "data.max_image_patches": 256,
    "data.synthetic.num_samples": 200, "data.synthetic.mix": {"text": 0.5, "image": 0.5},
    "data.synthetic.schedule": [{"step": 0, "mix": {"text": 1.0}}, {"step": 4, "mix": {"text": 1.0}},
                                {"step": 5, "mix": {"text": 0.05, "image": 0.95}}],
    "data.synthetic.image_side_px": {"min": 160, "max": 224},
    "model.flavor": "debug-enc",
    "parallel.nproc": 2, "parallel.dp_replicate": 2, "parallel.dp_shard": 1,
    "train.steps": 12, "train.grad_accum": 2, "train.warmup_steps": 1, "train.log_every": 1, "train.ckpt_every": 4,
    "train.timeout_s": 300,
    "replan.window": 10, "replan.every_steps": 5, "replan.cost_s": 0.01,
    "tracking.flush_every_s": 0.5,
}  # fmt: skip


def train(tmp_path, name: str, replan: bool):
    from flows.train import train_flow

    path = write_recipe(tmp_path / f"{name}.yaml", {**REPLAN_FLOW, "replan.enabled": replan}, tmp_path / name)
    return train_flow(str(path))


@pytest.mark.usefixtures("uncalibrated")
def test_a_replanned_job_keeps_its_data_order_and_its_losses(tmp_path, monkeypatch, mlflow_uri, prefect_harness):
    from mlflow import MlflowClient

    import flows.train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(flows.train, "POLL_S", 0.2)  # the look at step 5 lands before the checkpoint at 8
    replanned = train(tmp_path, "replanned", True)
    static = train(tmp_path, "static", False)

    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("replan-flow").experiment_id
    runs = client.search_runs([experiment])
    [run] = [r for r in runs if r.info.run_name == "train" and "replan/replans" in r.data.metrics]
    [static_run] = [r for r in runs if r.info.run_name == "train" and "replan/replans" not in r.data.metrics]
    assert replanned.steps == static.steps == 12
    assert run.data.metrics["replan/replans"] == 1 and replanned.plan != static.plan == "dp2x1"
    assert replanned.resumed_from_step == 8  # stopped at the checkpoint after the look at step 5 (or 6, 7)

    def losses(run_id: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)]

    assert losses(run.info.run_id) == pytest.approx(losses(static_run.info.run_id), rel=1e-4)

    looks = [r for r in runs if r.info.run_name.startswith("replan-")]
    [look] = [r for r in looks if r.data.tags["replan.decision"] == "replan"]
    assert look.data.tags["replan.decision"] == "replan" and look.data.tags["replan.to"] == replanned.plan
    assert look.data.metrics["replan/measured_step_s"] > 0 and look.data.metrics["replan/predicted_best_s"] > 0
    assert {"decision.json", "window_profile.json"} <= {a.path for a in client.list_artifacts(look.info.run_id)}
    assert {a.path for a in client.list_artifacts(run.info.run_id, "replan")} == {"replan/replan.png",
                                                                                 "replan/segments.json"}
    errors = client.get_metric_history(run.info.run_id, "estimate/error_pct")
    assert [m.step for m in errors] == [8, 12]  # each launch's prediction beside what it measured
