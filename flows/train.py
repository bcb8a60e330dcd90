"""Train stage: torchrun on the resolved recipe, rank 0 logging into this stage's MLflow run."""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows import resolve, stage_dir
from flows.launcher import run_torchrun
from omni_core.common.control import CONTROL_ENV, LAUNCHED_ENV, read_progress
from omni_core.common.plan import ParallelPlan
from omni_core.common.results import TrainResult
from omni_core.data.profile_result import DatasetProfile  # a flow parameter's type: Prefect validates it at run time
from omni_core.estimator.recipe_cells import prediction_error
from omni_core.estimator.search import CellTable
from omni_core.recipe import Recipe, dump_recipe
from omni_core.runtime.checkpoint import local_manifest
from omni_core.tracking import (
    SPOOL_FILE,
    MlflowTracker,
    TrackingError,
    current_parent_run_id,
    log_checkpoint,
    log_to_run,
    register_checkpoint,
    replay_when_reachable,
    stage_run,
)

if TYPE_CHECKING:
    from omni_core.estimator.cost import Estimate
    from omni_core.scheduler.replan import ReplanDecision


def planned(recipe: Recipe, cells: CellTable | None) -> Recipe:
    """The recipe with `parallel.plan: auto` replaced by the estimate's best plan for this machine's Cell;
    without the estimate stage's CellTable (`omni train` alone), that one Cell's estimate is made here."""
    if recipe.parallel.plan != "auto":
        return recipe
    from omni_core.estimator.recipe_cells import estimate_own_cells, with_best_plan
    from omni_core.runtime.perf import local_device_type

    device = local_device_type()
    return with_best_plan(recipe, cells or estimate_own_cells(recipe, device), device)


@flow(name="train")
def train_flow(
    recipe: Recipe | str,
    overrides: list[str] | None = None,
    cells: CellTable | None = None,
    run_name: str = "train",
    profile: DatasetProfile | None = None,
) -> TrainResult:
    """Run `torchrun -m omni_core.runtime.launch` on the resolved recipe (overrides applied; `parallel.plan:
    auto` replaced by the best plan of `cells` for this machine's Cell), with the MLflow run's id (named
    `run_name`: the schedule stage names each job's segment) in MLFLOW_RUN_ID; with `replan.enabled`, watched
    and relaunched under a new plan when its data drifts (`replanned`). The estimator's prediction for the plan
    (on `profile` when given) is logged beside what was measured. Then log the checkpoint (copied, or
    referenced when on S3), register it in the Model Registry under tracking.model_alias, and log
    train_result.json."""
    given = resolve(recipe, overrides)
    r = planned(given, cells)
    with stage_run(run_name, r, flow_run_id=flow_run.id) as run:
        run_dir = stage_dir(r, run.run_id)
        if r is not given:  # what ran is not what the experiment's recipe says: keep it beside the run
            run.set_tags({"plan.chosen_by": "estimate"})
        if r.replan.enabled:
            result = replanned(r, run, run_dir, run_name)
        else:
            result = launch(r, run, run_dir, run_dir / "recipe.yaml")
            log_prediction_error(run, run_name, predict_run(r, profile), result)
        source = log_checkpoint(run, result.checkpoint, local_manifest(r, result.checkpoint))
        register_checkpoint(
            run, name=r.tracking.registered_model or r.experiment.name, source=source, alias=r.tracking.model_alias
        )
        return result


def launch(r: Recipe, run: MlflowTracker, run_dir: Path, resolved: Path, control: Path | None = None) -> TrainResult:
    """One torchrun launch of `r` (written to `resolved` and logged), its result logged as train_result.json."""
    resolved.write_text(dump_recipe(r))
    run.log_artifact(resolved)
    result_path = run_dir / "train_result.json"
    env = {"MLFLOW_RUN_ID": run.run_id, "MLFLOW_TRACKING_URI": run.uri}
    if control is not None:
        env.update({CONTROL_ENV: str(control), LAUNCHED_ENV: str(time.time())})
    spool = run_dir / SPOOL_FILE  # what rank 0 could not send while the server was away
    try:
        result = run_torchrun.with_options(retries=r.train.launch_retries)(
            str(resolved),
            r.parallel.nproc,
            str(result_path),
            env,
            r.train.timeout_s,
            r.train.max_restarts,
            r.launch,
            r.experiment.name,
        )
    except BaseException:
        replay_when_reachable(run, spool, wait_s=0)
        raise
    replayed = replay_when_reachable(run, spool, wait_s=r.tracking.reconnect_timeout_s)
    if replayed is None:
        raise TrackingError(
            f"training finished ({result.steps} steps, checkpoint {result.checkpoint}), but MLflow at {run.uri} "
            f"stayed unreachable for tracking.reconnect_timeout_s={r.tracking.reconnect_timeout_s:g} s: its unsent "
            f"metrics reach the run when omni next reaches the server; the checkpoint is neither logged nor "
            "registered: run the same command again once the server is back (it resumes from that checkpoint)"
        )
    if replayed:
        get_run_logger().warning(f"{replayed} metrics the tracking server missed during training logged now")
    run.log_artifact(result_path)
    return result


def replanned(r: Recipe, run: MlflowTracker, run_dir: Path, run_name: str) -> TrainResult:
    """Launch, look every `replan.every_steps` steps (`scheduler.replan.Replanner`), and when a look (this
    one's, or `omni watch`'s) decides to re-plan, the job stops at its next checkpoint and is relaunched under
    the new plan. Every look is an MLflow run of its own beside this one (`replan-<step>`); the figure of the
    whole run is logged here, and each launch's prediction (over the windows it read:
    `Replanner.launch_predicted_s`) beside what it measured."""
    from omni_core.runtime.perf import local_device_type
    from omni_core.scheduler.replan import Replanner, control_folder, replan_figure

    control = control_folder(r)
    control.mkdir(parents=True, exist_ok=True)
    (control / PARENT_FILE).write_text(current_parent_run_id() or "")  # where `omni watch` files its looks
    replanner = Replanner(r, local_device_type(), control)
    pending_run = switch_run = None  # the look that asked for a stop; the one whose switch is running
    with ThreadPoolExecutor(max_workers=1) as pool:
        while True:
            recipe = replanner.launching()
            future = pool.submit(
                contextvars.copy_context().run,
                launch,
                recipe,
                run,
                run_dir,
                run_dir / f"recipe-{len(replanner.segments) + 1}.yaml",
                control,
            )
            while not future.done():
                wait([future], timeout=POLL_S)
                progress = read_progress(control)
                looked = replanner.on_progress(progress) if progress is not None else None
                if looked is not None:
                    look_run = log_decision(r, *looked)
                    pending_run = look_run if looked[0].replan else pending_run
            result = future.result()
            predicted = predict_run(recipe, replanner.reference)
            if predicted is not None:  # its memory on the window its plan was chosen on, its time on all it read
                predicted = replace(predicted, step_time_s=replanner.launch_predicted_s(result))
            log_prediction_error(run, run_name, predicted, result)
            again = replanner.launch_ended(result)
            if switch_run:  # the measured side of the re-plan that started this launch
                log_to_run(switch_run, run.uri, {"replan/measured_step_s": result.step_s}, step=result.steps)
            if not again:
                break
            switch_run, pending_run = pending_run, None
    run.log_metrics({"replan/replans": replanner.replans, "replan/looks": len(replanner.decisions)}, step=result.steps)
    run.log_dict([s.model_dump(mode="json") for s in replanner.segments], "replan/segments.json")
    run.log_artifact(
        replan_figure(replanner.segments, replanner.measured, replanner.decisions, run_dir / "replan.png"), "replan"
    )
    return result


PARENT_FILE = "parent_run"  # in the control folder: the MLflow run the job's looks are children of
POLL_S = 2.0  # how often the train stage reads its job's progress


def log_decision(r: Recipe, decision: ReplanDecision, window: DatasetProfile) -> str:
    """One look as its own MLflow run: the window's profile, the drift, both predictions, the decision."""
    with stage_run(f"replan-{decision.step}", r, flow_run_id=flow_run.id) as look_run:
        look_run.set_tags(
            {
                "replan.decision": "replan" if decision.replan else "keep",
                "replan.reason": decision.reason,
                "replan.from": decision.running_plan,
                "replan.to": decision.best_plan,
            }
        )
        look_run.log_metrics(decision.metrics(), step=decision.step)
        look_run.log_dict(decision.model_dump(mode="json"), "decision.json")
        look_run.log_dict(window.model_dump(mode="json"), "window_profile.json")
        return look_run.run_id


def predict_run(r: Recipe, profile: DatasetProfile | None) -> Estimate | None:
    """The estimator's step for the plan `r` runs on this machine, or None (with the reason logged) when it
    refuses the plan."""
    from omni_core.estimator.recipe_cells import predict_plan
    from omni_core.runtime.perf import local_device_type

    plan = ParallelPlan.from_config(r.parallel, r.parallel.nproc)
    try:
        return predict_plan(r, plan, profile, gpu_type=local_device_type())
    except ValueError as err:
        get_run_logger().warning("no prediction to compare the run with: %s", err)
        return None


def log_prediction_error(run: MlflowTracker, run_name: str, predicted: Estimate | None, result: TrainResult) -> None:
    """Predicted beside measured on the train run, and the step-time error on the experiment's parent run."""
    if predicted is None or result.steps == result.resumed_from_step:
        return
    error = prediction_error(predicted, result)
    run.log_metrics(error, step=result.steps)
    parent = current_parent_run_id()
    if parent:
        log_to_run(parent, run.uri, {f"estimate/{run_name}/error_pct": error["estimate/error_pct"]}, step=result.steps)
