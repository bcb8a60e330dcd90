"""Real mode of the scheduler through the experiment flow: two tiny jobs really placed, resized and trained on the
local cluster of CPU slots, tracked to MLflow."""

from __future__ import annotations

import pytest

from omni_core.scheduler.local import ScheduleRun
from tests.helpers.recipes import write_recipe
from tests.helpers.schedule_real import SCHEDULED, assert_never_double_booked

pytestmark = pytest.mark.usefixtures("uncalibrated")


def test_experiment_flow_schedules_two_tiny_jobs_and_resizes_one_mid_run(
    tmp_path, monkeypatch, mlflow_uri, prefect_harness
):
    """a starts alone on both slots; b arrives, a shrinks to one slot at its step-3 checkpoint and resumes
    from it under the new plan while b trains on the other slot. The jobs hold images: the estimate lays
    their encoders out in the omni layout (on one slot it runs as coupled would, the plan keeps the name)."""
    from mlflow import MlflowClient

    from flows.experiment import experiment_flow

    monkeypatch.chdir(tmp_path)
    summary = experiment_flow(str(write_recipe(tmp_path / "recipe.yaml", SCHEDULED, tmp_path / "out")))

    result = ScheduleRun.model_validate(summary["schedule"])
    assert "train" not in summary and all(job.finish_s is not None for job in result.jobs)
    a1, a2, b1 = sorted(result.segments, key=lambda s: (s.job, s.segment))
    assert (a1.num_gpus, a1.plan, a1.resumed_from_step, a1.last_step) == (2, "dp2+omni", 0, 3)
    assert (a2.num_gpus, a2.plan, a2.first_step, a2.resumed_from_step, a2.last_step) == (1, "dp1+omni", 3, 3, 6)
    assert (b1.num_gpus, b1.plan, b1.resumed_from_step, b1.last_step) == (1, "dp1+omni", 0, 3)
    assert [(r.job, r.step, r.from_plan, r.to_plan) for r in result.resizes] == [("a", 3, "dp2+omni", "dp1+omni")]
    a, b = result.results["a"], result.results["b"]
    assert (a.steps, a.plan, a.world_size, a.resumed_from_step) == (6, "dp1+omni", 1, 3)
    assert (b.steps, b.plan, b.resumed_from_step) == (3, "dp1+omni", 0)
    assert a2.start_s < b1.end_s and b1.start_s < a2.end_s  # they trained side by side
    assert_never_double_booked(result, 2)

    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("sched-test").experiment_id

    def children(run_id: str) -> dict:
        return {r.info.run_name: r for r in client.search_runs([experiment], f"tags.mlflow.parentRunId = '{run_id}'")}

    stages = children(summary["parent_run_id"])
    assert set(stages) == {"profile", "estimate", "schedule"}
    schedule = stages["schedule"]
    assert "schedule.json" in {f.path for f in client.list_artifacts(schedule.info.run_id)}
    assert schedule.data.metrics["schedule/resizes"] == 1
    launches = children(schedule.info.run_id)
    assert set(launches) == {"train-a-1", "train-a-2", "train-b-1"}
    assert launches["train-a-2"].data.tags["plan"] == "dp1+omni" and launches["train-a-1"].data.tags["plan"] == "dp2+omni"
    losses = client.get_metric_history(launches["train-a-2"].info.run_id, "train/loss")
    assert [m.step for m in losses] == [4, 5, 6]  # the step count continues from the checkpoint
