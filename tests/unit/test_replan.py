"""The watcher's decisions (scheduler/replan.py) on synthetic drift, with the real estimator and profiler: no
re-plan below the threshold, a re-plan above it, none when the predicted gain does not pay for the switch;
the stop request and the relaunch's recipe; which plan changes keep the data order."""

from __future__ import annotations

import pytest

from omni_core.common.control import TrainProgress, read_stop
from omni_core.recipe import override_recipe
from omni_core.scheduler.replan import (
    Replanner,
    best_overrides,
    drift,
    look,
    plan_of,
    predicted_step_s,
    same_data_order,
    window_profile,
)
from tests.helpers.recipes import build_recipe

pytestmark = pytest.mark.usefixtures("uncalibrated")

# a dynamic source whose mix turns from text alone to mostly images by step 20: the drift the watcher looks for
REPLAN = {
    "experiment.name": "replan-test", "experiment.seed": 0,
    "data.source": "dynamic", "data.seq_len": 512, "data.max_image_patches": 256,
    "data.synthetic.num_samples": 400, "data.synthetic.mix": {"text": 0.5, "image": 0.5},
    "data.synthetic.schedule": [{"step": 0, "mix": {"text": 1.0}}, {"step": 20, "mix": {"text": 0.05, "image": 0.95}}],
    "data.synthetic.image_side_px": {"min": 160, "max": 224},
    "model.flavor": "debug-enc",
    "parallel.nproc": 2, "parallel.dp_replicate": 2, "parallel.dp_shard": 1,
    "train.steps": 400, "train.grad_accum": 2, "train.ckpt_every": 10,
    "replan.enabled": True, "replan.window": 60,
}  # fmt: skip


@pytest.fixture
def recipe(tmp_path):
    return build_recipe(tmp_path / "out", REPLAN)


def progress(step: int, steps: int = 400, startup_s: float = 5.0) -> TrainProgress:
    return TrainProgress(step=step, steps=steps, plan="dp2x1", samples=0, step_s=1.0, startup_s=startup_s,
                         ckpt_s=0.5, resumed_from_step=0, updated_unix=0.0)


def test_drift_is_the_mix_distance_or_the_change_of_cost_per_sample(recipe):
    text = window_profile(recipe, 0, 0)
    images = window_profile(recipe, 30, 0)
    assert drift(text, text) == (0.0, 0.0, 0.0)
    distance, mix, flops = drift(text, images)
    a, b = ({m: q.share for m, q in p.modalities.items()} for p in (text, images))
    assert mix == pytest.approx(0.5 * sum(abs(a.get(m, 0) - b.get(m, 0)) for m in a.keys() | b.keys()))
    assert 0.8 < mix < 1 and flops > 1 and distance == max(mix, flops)


def test_no_replan_below_the_threshold(recipe):
    decision, _ = look(recipe, progress(5), window_profile(recipe, 5, 0), "cpu")
    assert not decision.replan and decision.drift < recipe.replan.drift_threshold
    assert "below replan.drift_threshold" in decision.reason


def test_a_drift_whose_gain_pays_replans_and_asks_the_job_to_stop(recipe):
    """Text at the start, images at step 30: the encoders' layout moves, and 370 steps pay for a cheap switch."""
    cheap = override_recipe(recipe, ["replan.cost_s=0.01"])
    decision, window = look(cheap, progress(30), window_profile(cheap, 0, 0), "cpu")
    assert decision.replan, decision.reason
    assert decision.best_plan != decision.running_plan == "dp2x1"
    assert decision.predicted_best_s < decision.predicted_running_s
    assert decision.gain_s == pytest.approx(decision.remaining_steps * 1.0 * (  # the measured 1 s per step
        1 - decision.predicted_best_s / decision.predicted_running_s))
    assert decision.stop_step == 40 and decision.remaining_steps == 360
    assert plan_of(override_recipe(cheap, decision.overrides)).name == decision.best_plan
    assert window.modalities["image"].share > 0.8


def test_no_replan_when_the_gain_does_not_pay_for_the_switch(recipe):
    costly = override_recipe(recipe, ["replan.cost_s=1e6"])
    decision, _ = look(costly, progress(30), window_profile(costly, 0, 0), "cpu")
    assert not decision.replan and decision.drift > costly.replan.drift_threshold
    assert decision.best_plan != decision.running_plan and "less than a re-plan's 1000000.0 s" in decision.reason
    measured = look(recipe, progress(30, steps=45, startup_s=60.0), window_profile(recipe, 0, 0), "cpu")[0]
    assert measured.cost_s == 60.5 and not measured.replan  # the running launch's own startup and save


def test_the_replanner_looks_every_checkpoint_then_relaunches_under_the_request(recipe, tmp_path):
    folder = tmp_path / "control"
    folder.mkdir()
    replanner = Replanner(override_recipe(recipe, ["replan.cost_s=0.01"]), "cpu", folder)
    first = replanner.launching()
    assert first.train.ckpt_dir == recipe.checkpoint_dir()  # pinned: the relaunch resumes the same directory
    assert replanner.on_progress(progress(5)) is None  # the reference window is taken; no look before step 10
    assert (folder / "reference.json").is_file() and (folder / "recipe.yaml").is_file()
    decision, _ = replanner.on_progress(progress(30))
    assert decision.replan and read_stop(folder).plan == decision.best_plan
    assert replanner.on_progress(progress(35)) is None  # stopping: no more looks in this launch

    from omni_core.common.results import TrainResult

    stopped = TrainResult(steps=40, world_size=2, plan="dp2x1", initial_loss=5.0, final_loss=4.0, tokens_per_s=1.0,
                          samples_per_s=1.0, wall_s=40.0, logging_overhead_pct=0.0, mfu_pct=None, peak_mem_mb=1.0,
                          checkpoint="ckpt", launch_step_s=40.0)
    assert replanner.launch_ended(stopped)
    assert plan_of(replanner.recipe).name == decision.best_plan and replanner.recipe.train.resume
    assert replanner.recipe.train.ckpt_dir == recipe.checkpoint_dir()
    assert replanner.launching() and read_stop(folder) is None  # the next launch starts with no request
    assert replanner.segments[0].measured_step_s == 1.0 and replanner.replans == 1
    # the launch is priced on what it read: the text reference for steps 0-30, the images of the look's window
    # for steps 30-40 (on its reference alone it would be priced as text throughout)
    text_s = predicted_step_s(first, window_profile(first, 0, 0), "cpu")
    assert decision.predicted_running_s > 1.2 * text_s
    expected = (30 * text_s + 10 * decision.predicted_running_s) / 40
    assert replanner.segments[0].predicted_step_s == pytest.approx(expected)


def test_a_look_that_finds_the_running_plan_best_makes_its_window_the_reference(recipe, tmp_path):
    images = window_profile(recipe, 30, 0)
    best = override_recipe(recipe, best_overrides(recipe, images, "cpu"))
    folder = tmp_path / "control"
    folder.mkdir()
    replanner = Replanner(best, "cpu", folder)
    replanner.launching()
    replanner.on_progress(progress(5))  # the reference: the text the launch starts on
    confirmed, _ = replanner.on_progress(progress(30))
    assert confirmed.drift > confirmed.threshold and not confirmed.replan and not confirmed.overrides
    assert "still the best" in confirmed.reason
    again, _ = replanner.on_progress(progress(40))  # the same images: no drift from where it was found best
    assert again.drift < again.threshold and again.best_plan == again.running_plan


def test_a_job_running_fewer_data_shards_than_ranks_keeps_its_global_batch(recipe):
    piped = override_recipe(recipe, ["parallel.dp_replicate=1", "parallel.pp=2", "train.grad_accum=4"])
    best = override_recipe(piped, best_overrides(piped, window_profile(piped, 30, 0), "cpu"))
    assert best.data.micro_batch * best.train.grad_accum * plan_of(best).dp == 4  # 1 x 4 x dp 1


def test_same_data_order_needs_the_same_shards_and_sequences_per_step(recipe):
    assert same_data_order(recipe, override_recipe(recipe, ["parallel.encoders.layout=omni"]))
    regrouped = ["data.micro_batch=2", "train.grad_accum=1"]
    assert same_data_order(recipe, override_recipe(recipe, regrouped))  # balancing places per step
    assert not same_data_order(recipe, override_recipe(recipe, [*regrouped, "data.balance.policy=none"]))
    assert not same_data_order(recipe, override_recipe(recipe, ["parallel.dp_replicate=1", "parallel.tp=2"]))


def test_the_window_of_a_file_source_is_what_the_job_reads_next(tmp_path):
    """Past the samples read: the window's counts are the stream's from there on."""
    from collections import Counter

    from omni_core.data.dataset import open_dataset
    from omni_core.data.synthetic import ensure_dataset
    from tests.helpers.data_sources import SOURCES, records

    recipe = build_recipe(tmp_path, {**SOURCES, "data.synthetic.num_samples": 60, "data.synthetic.format": "jsonl",
                                     "data.profile_window": 10})
    ensure_dataset(recipe)
    recipe = override_recipe(recipe, ["replan.window=20"])
    expected = Counter(r.modality for r in records(open_dataset(recipe))[25:45])
    window = window_profile(recipe, step=3, samples=25)
    assert window.total_samples == 20
    assert {m: p.count for m, p in window.modalities.items()} == dict(expected)


def test_omni_watch_looks_from_the_control_folder_and_leaves_its_stop_request_there(recipe):
    from omni_core.scheduler.replan import control_folder, look_from_outside

    cheap = override_recipe(recipe, ["replan.cost_s=0.01"])
    with pytest.raises(ValueError, match="no re-planned job of experiment 'replan-test' is running"):
        look_from_outside(cheap, "cpu")
    folder = control_folder(cheap)
    folder.mkdir(parents=True)
    replanner = Replanner(cheap, "cpu", folder)
    replanner.launching()
    replanner.on_progress(progress(5))  # the job's first report: the reference window
    progress(30).save(folder / "progress.json")
    decision, _ = look_from_outside(cheap, "cpu")
    assert decision.replan and read_stop(folder).plan == decision.best_plan
    with pytest.raises(ValueError, match="already stopping"):
        look_from_outside(cheap, "cpu")
