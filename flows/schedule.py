"""Schedule stage (real mode): the scheduler places the recipe's jobs on CPU slots (here, or Slurm nodes), and
each placed job trains segment by segment, every segment a train subflow with the plan of its slots."""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from flows import resolve, stage_dir
from flows.train import train_flow
from omni_core.common.results import TrainResult
from omni_core.data.profile_result import DatasetProfile
from omni_core.estimator.search import CellTable
from omni_core.recipe import Recipe
from omni_core.scheduler.local import JobRun, ScheduleRun, run_schedule
from omni_core.tracking import children_of, stage_run


@flow(name="schedule")
def schedule_flow(
    recipe: Recipe | str,
    overrides: list[str] | None = None,
    profile: DatasetProfile | None = None,
    cells: CellTable | None = None,
) -> ScheduleRun:
    """Run real mode (omni_core.scheduler.local), its throughput oracle answering from `cells` (the estimate
    stage's CellTable) where it holds the Cell: each launch is the train flow on the job's own recipe (this
    recipe, `overrides`, then the launch's overrides), its MLflow run a child of this stage's run. Logs
    schedule.json (segments, plans, resizes, decisions, TrainResults) and per-job JCT metrics."""
    r = resolve(recipe, overrides)
    with stage_run("schedule", r, flow_run_id=flow_run.id) as run, children_of(run.run_id):

        def train(launch: JobRun) -> TrainResult:
            return train_flow.with_options(flow_run_name=launch.name)(
                r, list(launch.overrides), run_name=launch.name, profile=profile
            )

        result = run_schedule(r, train, profile=profile, cells=cells)
        run.log_metrics(result.metrics(), step=0)
        run.log_artifact(result.save(stage_dir(r, run.run_id) / "schedule.json"))
        return result
