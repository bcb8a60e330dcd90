"""`omni simulate` tracking to MLflow: the schedule, plans and figures on one run of a sqlite store."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.recipes import write_recipe


def test_omni_simulate_logs_schedule_plans_and_figures_to_mlflow(tmp_path: Path, mlflow_uri: str, capsys):
    from mlflow import MlflowClient

    from flows.cli import main

    recipe = write_recipe(tmp_path / "sim.yaml", {
        "experiment.name": "sim-mlflow",
        "cluster.node_groups": [{"gpu_type": "a100", "nodes": 1, "gpus_per_node": 4}],
        "jobs": [{"name": "a", "model": "bert__760M", "global_batch": 128, "iterations": 100}],
        "schedule.max_rounds": 20,
    }, tmp_path)
    assert main(["simulate", str(recipe)]) == 0
    assert "crius" in capsys.readouterr().out
    client = MlflowClient(mlflow_uri)
    run = client.search_runs([client.get_experiment_by_name("sim-mlflow").experiment_id])[0]
    assert run.info.run_name == "simulate" and run.data.metrics["sim/crius/jobs_finished"] == 1
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"schedule_crius.json", "throughput.png", "gantt_crius.png", "summary.txt"} <= files
