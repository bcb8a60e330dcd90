"""The experiment flow end to end: Prefect test harness, torchrun on 1 CPU rank, a temporary sqlite MLflow
store; everything is checked through MlflowClient, the way a user would find it."""

from __future__ import annotations

import pytest

from tests.helpers.recipes import write_recipe

FLOW = {"experiment.name": "flow-test", "experiment.seed": 0, "data.synthetic.num_samples": 60, "data.seq_len": 256,
        "model.flavor": "debug", "parallel.nproc": 1, "train.steps": 30, "train.warmup_steps": 2, "train.log_every": 2,
        "train.ckpt_every": 0, "train.timeout_s": 300, "eval.max_batches": 2, "tracking.flush_every_s": 0.5}


def artifact_paths(client, run_id: str, path: str | None = None) -> set[str]:
    return {a.path for a in client.list_artifacts(run_id, path)}


def test_experiment_flow_logs_a_parent_run_with_a_child_run_per_stage(tmp_path, monkeypatch, mlflow_uri, prefect_harness):
    """With `parallel.plan: auto`, so the train stage runs the estimate stage's best plan for its Cell."""
    from mlflow import MlflowClient

    from flows.experiment import experiment_flow
    from omni_core.common.catalog import GpuCatalog
    from omni_core.estimator.calibration import calibration_digest, store_calibration
    from omni_core.estimator.cost import Efficiency
    from omni_core.recipe import load_recipe, recipe_hash

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMNI_CALIBRATION_DIR", str(tmp_path / "calibration"))
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")  # the training lasts seconds
    store_calibration(GpuCatalog()["cpu"], Efficiency(), {"note": "a stored calibration the estimate must log"})
    recipe = write_recipe(tmp_path / "recipe.yaml", FLOW, tmp_path / "out")

    summary = experiment_flow(str(recipe), ["train.steps=20", "parallel.plan=auto"])

    client = MlflowClient(mlflow_uri)
    assert summary["tracking_uri"] == mlflow_uri and summary["experiment_name"] == "flow-test"
    parent = client.get_run(summary["parent_run_id"])
    assert parent.info.run_name.startswith("flow-test-") and parent.info.status == "FINISHED"
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # MLflow opens its runs
    tags = parent.data.tags
    assert tags["recipe.hash"] == summary["recipe_hash"] and tags["git.sha"] and tags["prefect.flow_run_id"]
    assert parent.data.params["train.steps"] == "20" and parent.data.params["parallel.nproc"] == "1"
    assert "recipe.yaml" in artifact_paths(client, parent.info.run_id)

    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    stages = {r.info.run_name: r for r in children}
    assert set(stages) == {"profile", "estimate", "train", "evaluate"}
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.tags["prefect.flow_run_id"] not in ("", tags["prefect.flow_run_id"])  # its own subflow
        if run.info.run_name != "train":
            assert run.data.tags["recipe.hash"] == summary["recipe_hash"]

    estimate = stages["estimate"]
    assert {"cells.json", "cells.png"} <= artifact_paths(client, estimate.info.run_id)
    assert summary["estimate"]["cells"] and not summary["estimate"]["unfit"]
    assert summary["estimate"]["calibrations"] == {"cpu": calibration_digest("cpu")} != {"cpu": ""}
    assert estimate.data.tags["estimate.calibration.cpu"] == calibration_digest("cpu")
    assert artifact_paths(client, estimate.info.run_id, "calibration") == {"calibration/cpu.json"}

    profile = stages["profile"]
    files = artifact_paths(client, profile.info.run_id)
    assert "profile.json" in files and any(f.endswith(".png") for f in files)
    assert profile.data.metrics["profile/samples"] == summary["profile"]["total_samples"]

    train = stages["train"]
    losses = client.get_metric_history(train.info.run_id, "train/loss")
    assert [m.step for m in losses] == list(range(2, 21, 2))
    assert "system/node0/cpu_utilization_percentage" in train.data.metrics  # MLflow's system metrics, per node
    assert train.data.tags["plan"] == summary["train"]["plan"]
    [best] = [c for c in summary["estimate"]["cells"] if (c["gpu_type"], c["num_gpus"]) == ("cpu", 1)]
    assert train.data.tags["plan.chosen_by"] == "estimate" and summary["train"]["plan"] == best["plan"]
    ran = load_recipe(client.download_artifacts(train.info.run_id, "recipe.yaml", str(tmp_path)))
    assert ran.parallel.plan == "explicit" and train.data.tags["recipe.hash"] == recipe_hash(ran)
    assert {"checkpoint", "train_result.json"} <= artifact_paths(client, train.info.run_id)
    assert artifact_paths(client, train.info.run_id, "checkpoint")
    assert summary["train"]["steps"] == 20
    assert train.data.tags["checkpoint.uri"] == summary["train"]["checkpoint"]
    assert "manifest.json" in {p.rsplit("/", 1)[-1] for p in artifact_paths(client, train.info.run_id, "checkpoint")}
    registered = client.get_model_version_by_alias("flow-test", "current")
    assert registered.run_id == train.info.run_id and registered.source.endswith("checkpoint")

    evaluate = stages["evaluate"]
    assert summary["evaluate"]["checkpoint"] == summary["train"]["checkpoint"]  # handed over, not looked up
    files = artifact_paths(client, evaluate.info.run_id)
    assert "eval_report.json" in files and any(f.endswith(".png") for f in files)
    metrics = evaluate.data.metrics
    assert metrics["eval/loss"] == pytest.approx(summary["evaluate"]["loss"])
    assert "eval/perplexity" in metrics
    for modality in summary["evaluate"]["per_modality"]:
        assert f"eval/{modality}/loss" in metrics


def test_validate_flow_logs_predicted_against_measured(tmp_path, monkeypatch, mlflow_uri, prefect_harness):
    """Two short plans (one and two ranks) through the real runtime: the report and MLflow agree, and every
    case has a finite prediction and measurement."""
    from mlflow import MlflowClient

    import omni_core.measure.validate as validate
    from flows.validate import validate_flow

    cases = [validate.Case("debug", "dp1", 128, mix="text", steps=4), validate.Case("debug", "dp2", 128, steps=4)]
    monkeypatch.setattr(validate, "validation_cases", lambda quick: cases)
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path / "recipe.yaml", FLOW, tmp_path / "out")

    report = validate_flow(str(recipe), ["estimate.validation=quick"])

    assert [r.case for r in report.rows] == [c.name for c in cases] and report.rounds == 1
    assert all(0 < r.predicted_s < 60 and 0 < r.measured_s < 60 for r in report.rows)
    assert set(report.mape_pct_by_world) == {"1", "2"}
    client = MlflowClient(mlflow_uri)
    [run] = client.search_runs([client.get_experiment_by_name("flow-test").experiment_id],
                               "attributes.run_name = 'validate'")
    assert run.data.metrics["validate/mape_pct"] == pytest.approx(report.mape_pct)
    assert run.data.metrics["validate/mape_pct/world2"] == pytest.approx(report.mape_pct_by_world["2"])
    assert {"validation.json", "validation.png"} <= artifact_paths(client, run.info.run_id)


def test_a_launch_broken_from_outside_is_retried_and_resumes(tmp_path, mlflow_uri, prefect_harness):
    """kill -9 of a rank with no torchrun restarts: the rank's peer fails on losing it, the launch is an
    infrastructure failure, and the torchrun task launches again, resuming the newest checkpoint."""
    import os
    import signal
    import threading
    import time

    from mlflow import MlflowClient

    from flows.train import train_flow
    from tests.helpers.runtime import worker_pid

    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "recipe.yaml", {
        "experiment.name": "retried", "data.synthetic.num_samples": 200, "data.seq_len": 256, "parallel.nproc": 2,
        "train.steps": 30, "train.log_every": 10, "train.ckpt_every": 10, "train.dist_timeout_s": 60,
        "train.timeout_s": 300, "train.launch_retries": 1, "tracking.flush_every_s": 0.5,
    }, out)
    killed: list[int] = []

    def kill_rank_1_after_the_first_checkpoint() -> None:
        deadline = time.monotonic() + 240
        while not any(out.rglob("step_000010/manifest.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        pid = worker_pid(str(out), 1)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    killer = threading.Thread(target=kill_rank_1_after_the_first_checkpoint, daemon=True)
    killer.start()
    result = train_flow(str(recipe))
    killer.join(5)
    assert killed, "rank 1 was never found to kill"
    assert result.steps == 30 and result.resumed_from_step >= 10
    [run] = MlflowClient(mlflow_uri).search_runs(
        [MlflowClient(mlflow_uri).get_experiment_by_name("retried").experiment_id])
    assert run.info.status == "FINISHED"
