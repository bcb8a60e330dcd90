"""Real mode of the scheduler: placement decisions on the local cluster of CPU slots (no training) and the
concurrent launch loop with a stand-in for training (two tiny jobs really placed, resized and trained through the
experiment flow: tests/flows/test_schedule_real_flows.py)."""

from __future__ import annotations

import threading
import time

import pytest

from omni_core.common.results import TrainResult
from omni_core.recipe import RecipeError, load_recipe
from omni_core.scheduler.local import JobRun, LocalScheduler, ScheduleRun, run_schedule
from tests.helpers.recipes import write_recipe
from tests.helpers.schedule_real import SCHEDULED, assert_never_double_booked

pytestmark = pytest.mark.usefixtures("uncalibrated")


def finished(run: JobRun, resumed_from: int | None = None) -> TrainResult:
    """What the trainer reports after a launch that trained to its last step."""
    return TrainResult(
        steps=run.last_step, world_size=run.slots, plan=run.plan, initial_loss=5.0, final_loss=4.0, tokens_per_s=1.0,
        samples_per_s=1.0, wall_s=1.0, logging_overhead_pct=0.0, mfu_pct=None, peak_mem_mb=1.0, checkpoint="ckpt",
        resumed_from_step=run.first_step if resumed_from is None else resumed_from,
        launch_step_s=2.0 * (run.last_step - run.first_step), launch_samples=run.last_step - run.first_step,
    )


# --- decisions, no training -------------------------------------------------------------------------------

def test_a_running_job_shrinks_at_its_segment_end_so_an_arrival_starts(tmp_path):
    path = write_recipe(tmp_path / "recipe.yaml", SCHEDULED, tmp_path / "out")
    recipe = load_recipe(path)
    s = LocalScheduler(recipe)
    assert s.admit(0.0) == ["a"]
    [a1] = s.decide(0.0, "a arrived")
    assert (a1.slots, a1.plan, a1.first_step, a1.last_step) == (2, "dp2", 0, 3)  # alone, it takes both slots

    assert s.admit(1.0) == ["b"] and s.decide(1.0, "b arrived") == []  # a is inside its segment: b waits
    assert s.decisions[-1].chosen == {"a": 1, "b": 1} and s.decisions[-1].held == {"a": 2}

    s.ended(a1, finished(a1), 5.0)
    a2, b1 = sorted(s.decide(5.0, "train-a-1 ended"), key=lambda r: r.job)
    assert (a2.slots, a2.plan, a2.first_step, a2.last_step, a2.segment) == (1, "dp1", 3, 6, 2)
    assert (b1.slots, b1.plan, b1.first_step, b1.last_step) == (1, "dp1", 0, 3)
    [resize] = s.resizes
    assert (resize.job, resize.step, resize.from_slots, resize.to_slots, resize.to_plan) == ("a", 3, 2, 1, "dp1")

    # The launches' recipes: the plan's ranks, the job's global batch kept, one checkpoint directory per job
    first, second, other = (load_recipe(path, run.overrides) for run in (a1, a2, b1))
    assert (first.parallel.nproc, second.parallel.nproc) == (2, 1)
    assert (first.train.stop_at_step, second.train.stop_at_step) == (3, 6)
    assert first.train.steps == second.train.steps  # the LR schedule spans the whole job
    for r, dp in ((first, 2), (second, 1), (other, 1)):
        assert r.data.micro_batch * r.train.grad_accum * dp == 2 and r.jobs == []
        assert r.mlflow_experiment() == "sched-test" and r.data_dir() == recipe.data_dir()
    assert first.training_hash() != second.training_hash()  # the plans' accumulation differs...
    assert first.checkpoint_dir() == second.checkpoint_dir() != other.checkpoint_dir()  # ...the directory does not
    assert second.experiment.name == "sched-test-a" and second.train.resume


def test_the_loop_runs_placed_jobs_concurrently_and_never_double_books(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", {**SCHEDULED, "jobs.1.arrival_s": 0.2}, tmp_path / "out"))
    active, most = set(), 0
    lock = threading.Lock()

    def train(run: JobRun) -> TrainResult:
        nonlocal most
        with lock:
            active.add(run.name)
            most = max(most, len(active))
        time.sleep(0.6)
        with lock:
            active.discard(run.name)
        return finished(run)

    result = run_schedule(recipe, train)
    assert most == 2  # a's second segment and b ran at the same time
    assert all(job.finish_s is not None for job in result.jobs)
    assert [(s.job, s.segment, s.num_gpus) for s in sorted(result.segments, key=lambda s: (s.start_s, s.job))] == [
        ("a", 1, 2), ("a", 2, 1), ("b", 1, 1)]
    triggers = [d.trigger for d in result.decisions]
    assert triggers[:3] == ["a arrived", "b arrived", "train-a-1 ended"]
    assert {"train-a-2 ended", "train-b-1 ended"} <= set(", ".join(triggers[3:]).split(", "))  # together or not
    assert {j: r.steps for j, r in result.results.items()} == {"a": 6, "b": 3}
    assert_never_double_booked(result, 2)
    assert ScheduleRun.from_json(result.to_json()) == result
    for s in result.segments:  # what the policy expected of each launch, beside what it got
        assert s.expected_samples_per_s > 0 and s.measured_samples_per_s == 0.5
        assert result.metrics()[f"schedule/{s.job}/{s.segment}/expected_samples_per_s"] == s.expected_samples_per_s


def test_a_failed_launch_stops_new_ones_and_is_raised_after_the_running_ones_end(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", {**SCHEDULED, "jobs.1.arrival_s": 0.0}, tmp_path / "out"))
    started = []

    def train(run: JobRun) -> TrainResult:
        started.append(run.name)
        if run.job == "b":
            raise RuntimeError("b crashed")
        time.sleep(0.3)
        return finished(run)

    with pytest.raises(RuntimeError, match="b crashed"):
        run_schedule(recipe, train)
    assert sorted(started) == ["train-a-1", "train-b-1"]  # a's next segment never started


def test_on_slurm_nodes_each_launch_is_pinned_to_the_nodes_the_job_was_placed_on(tmp_path):
    """Two one-slot Slurm nodes: a alone takes both (one rank per node), then a and b one node each."""
    nodes = ["cluster.node_groups=[{gpu_type: cpu, nodes: 2, gpus_per_node: 1, hosts: [n1, n2]}]",
             "launch.target=slurm"]
    path = write_recipe(tmp_path / "recipe.yaml", SCHEDULED, tmp_path / "out")
    s = LocalScheduler(load_recipe(path, nodes))
    s.admit(0.0)
    [a1] = s.decide(0.0, "a arrived")
    s.admit(1.0)
    s.decide(1.0, "b arrived")
    s.ended(a1, finished(a1), 5.0)
    a2, b1 = sorted(s.decide(5.0, "train-a-1 ended"), key=lambda r: r.job)
    launches = [load_recipe(path, [*nodes, *run.overrides]).launch for run in (a1, a2, b1)]
    assert [(launch.nodes, launch.nodelist) for launch in launches] == [(2, ["n1", "n2"]), (1, ["n1"]), (1, ["n2"])]
    assert load_recipe(path, [*nodes, *a1.overrides]).parallel.nproc == 2

    with pytest.raises(ValueError, match="past one node only on Slurm"):
        LocalScheduler(load_recipe(path, nodes[:1]))
    with pytest.raises(RecipeError, match="hosts names 1 node"):
        load_recipe(path, ["cluster.node_groups=[{gpu_type: cpu, nodes: 2, gpus_per_node: 1, hosts: [n1]}]"])


def test_real_mode_refuses_what_it_cannot_run_in_one_message(tmp_path):
    two_nodes = "cluster.node_groups=[{gpu_type: a100, nodes: 2, gpus_per_node: 4}]"
    path = write_recipe(tmp_path / "recipe.yaml", SCHEDULED, tmp_path / "out")
    recipe = load_recipe(path, ["jobs.0.model=bert__1.3B", "jobs.1.name=a", two_nodes])
    with pytest.raises(ValueError) as error:
        LocalScheduler(recipe)
    message = str(error.value)
    assert "2x4 a100" in message and "bert__1.3B" in message and "taken by jobs[0]" in message
    with pytest.raises(RecipeError, match="slots=3 must be a power of two"):
        load_recipe(path, ["cluster.slots=3"])


def test_omni_schedule_reports_a_recipe_it_cannot_run_before_starting_anything(tmp_path, capsys):
    from flows.cli import main

    path = write_recipe(tmp_path / "recipe.yaml", SCHEDULED, tmp_path / "out")
    assert main(["schedule", str(path), "--set", "jobs.1.model=moe__10B"]) == 2
    assert "omni: schedule: jobs[1].model 'moe__10B' is not a model flavor" in capsys.readouterr().err
