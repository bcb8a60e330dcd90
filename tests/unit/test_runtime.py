"""Runtime in one process: loss bookkeeping, LR schedule, data-parallel numerics, training, checkpoint/resume, eval
(checkpoints on S3: tests/integration/test_runtime_s3.py; a torchrun launch: tests/ranks/test_runtime_ranks.py)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from omni_core.common.batch import MODALITY_IDS, audio_tokens, video_tokens
from omni_core.common.loss import summarize, token_loss_sums
from omni_core.common.plan import PlanError
from omni_core.common.results import TrainResult
from omni_core.recipe.model_sections import ParallelConfig
from omni_core.runtime.checkpoint import latest_checkpoint
from omni_core.runtime.ckpt_store import MANIFEST, CheckpointError, LocalStore, checkpoint_store, step_name
from omni_core.runtime.evaluate import evaluate_checkpoint
from omni_core.runtime.lr_schedule import lr_lambda
from omni_core.runtime.plan_rules import resolve_plan
from omni_core.runtime.trainer import train
from tests.helpers.models import MERGES
from tests.helpers.recipes import build_recipe
from tests.helpers.runtime import CPU, RecordingTracker


def fake_batch(labels: list[int], modality: list[int]) -> SimpleNamespace:
    return SimpleNamespace(labels=torch.tensor(labels), loss_modality=torch.tensor(modality))


def test_loss_sums_equal_token_mean_and_split_by_modality():
    torch.manual_seed(0)
    logits = torch.randn(5, 7)
    batch = fake_batch([1, -100, 3, 6, 0], [0, 0, 1, 1, 2])
    sums = token_loss_sums(logits, batch)
    expected = F.cross_entropy(logits, batch.labels, ignore_index=-100)
    means = summarize(sums.stats().tolist())
    assert means["loss"] == pytest.approx(float(expected), rel=1e-6)
    image_mean = F.cross_entropy(logits[2:4], batch.labels[2:4])
    assert means["loss/image"] == pytest.approx(float(image_mean), rel=1e-6)
    assert sums.counts.tolist() == [1.0, 2.0, 1.0, 0.0]  # text, image, audio, video
    assert set(means) == {"loss", "loss/text", "loss/image", "loss/audio"}


def test_documents_of_a_batch_own_exactly_their_media(tmp_path):
    from omni_core.common.tokenizer import AUDIO_ID, BYTE_TOKENIZER, IMAGE_ID
    from omni_core.data.dataset import open_dataset
    from omni_core.data.loader import PackedLoader
    from omni_core.runtime.generate import documents

    recipe = build_recipe(tmp_path)
    batch = next(iter(PackedLoader(open_dataset(recipe), recipe.data, "train")))
    docs = list(
        documents(batch, BYTE_TOKENIZER, lambda rows, cols: rows * cols, lambda *grid: video_tokens(*grid, *MERGES))
    )
    assert len(docs) == batch.num_samples
    assert {d.modality for d in docs} == {"text", "image", "audio"}
    for doc in docs:
        assert int((doc.input_ids == IMAGE_ID).sum()) == len(doc.image_patches) == int(doc.image_grids.prod(1).sum())
        assert int((doc.input_ids == AUDIO_ID).sum()) == sum(audio_tokens(int(f)) for f in doc.audio_frames)
        assert len(doc.audio_mels) == int(doc.audio_frames.sum())
    assert torch.equal(torch.cat([d.image_patches for d in docs]), batch.image_patches)
    assert torch.equal(torch.cat([d.audio_mels for d in docs]), batch.audio_mels)


def test_word_accuracy_counts_reference_words_in_place():
    from omni_core.runtime.generate import word_accuracy

    assert word_accuracy("a red circle on blue.", "a red circle on blue.") == 1.0
    assert word_accuracy("a red square on blue.", "a red circle on blue.") == 0.8
    assert word_accuracy("red circle", "a red circle on blue.") == 0.0
    assert word_accuracy("", "do mi") == 0.0


def test_lr_schedule_warms_up_then_decays_to_floor():
    values = [lr_lambda(s, warmup=4, total=20, floor=0.1) for s in range(21)]
    assert values[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert values[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[4:], values[5:]))
    assert values[20] == pytest.approx(0.1)


def test_recipe_plan_is_checked_against_world_and_model(tmp_path):
    recipe = build_recipe(tmp_path)
    assert resolve_plan(recipe, 4).name == "dp4"
    recipe.parallel = ParallelConfig(dp_replicate=2, tp=2)
    assert resolve_plan(recipe, 8).name == "dp2x2-tp2"
    with pytest.raises(PlanError, match=r"but the world size is 2"):
        recipe.parallel = ParallelConfig(dp_shard=3)
        resolve_plan(recipe, 2)
    with pytest.raises(PlanError, match=r"tp=3 does not divide n_heads=4"):
        recipe.parallel = ParallelConfig(tp=3)
        resolve_plan(recipe, 3)
    with pytest.raises(PlanError, match=r"pp=2 \(1F1B\) needs at least 2 micro-batches per step, got 1"):
        recipe.parallel = ParallelConfig(pp=2)
        resolve_plan(recipe, 2)


def test_training_lowers_loss_and_evaluates(tmp_path):
    recipe = build_recipe(tmp_path, {"train.steps": 30, "train.lr": 5e-3})
    tracker = RecordingTracker()
    result = train(recipe, CPU, tracker=tracker, log=lambda _: None)
    assert result.steps == 30
    assert result.final_loss < 0.75 * result.initial_loss
    assert result.tokens_per_s > 0 and result.samples_per_s > 0
    assert sorted(tracker.metrics) == list(range(1, 31))
    assert tracker.metrics[1]["train/loss"] == pytest.approx(result.initial_loss)
    assert tracker.metrics[30]["perf/tokens_per_s"] > 0
    assert "train/aux_loss" not in tracker.metrics[30]  # dense model: no MoE term
    assert result.checkpoint == str(Path(recipe.checkpoint_dir()) / step_name(30))

    report = evaluate_checkpoint(recipe)
    assert report.step == 30 and report.samples > 0
    assert report.perplexity == pytest.approx(math.exp(report.loss))
    assert set(report.per_modality) <= set(MODALITY_IDS) and report.per_modality
    assert report.task and set(report.task) <= {"image", "audio"}
    for score in report.task.values():
        assert 0 < score.samples <= recipe.eval.generate_samples and 0 <= score.word_accuracy <= 1
        assert score.answer_exact_match >= score.exact_match and 0 <= score.answer_token_f1 <= 1
        assert score.examples and all(reference for _, reference in score.examples)


def test_a_checkpoint_save_is_not_counted_in_the_next_steps_time(tmp_path, monkeypatch):
    from omni_core.runtime.trainer import TrainingRun

    save = TrainingRun.checkpoint

    save_s = 2.0  # longer than a step of the tiny model takes even on a loaded host

    def slow_save(self, step, history):
        time.sleep(save_s)
        return save(self, step, history)

    monkeypatch.setattr(TrainingRun, "checkpoint", slow_save)
    recipe = build_recipe(tmp_path, {"train.steps": 3, "train.ckpt_every": 2, "train.log_every": 1})
    tracker = RecordingTracker()
    result = train(recipe, CPU, tracker=tracker, log=lambda _: None)
    assert result.step_s < save_s  # the saves' seconds are outside the run's steps
    assert tracker.metrics[3]["perf/step_s"] < save_s  # and outside the log window after the save at step 2


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    straight = RecordingTracker()
    train(build_recipe(tmp_path / "a"), CPU, tracker=straight, log=lambda _: None)

    interrupted = build_recipe(tmp_path / "b", {"train.ckpt_every": 3})
    first = RecordingTracker()
    partial = train(interrupted, CPU, tracker=first, log=lambda _: None, stop_after=3)
    assert partial.steps == 3
    resumed = RecordingTracker()
    result = train(interrupted, CPU, tracker=resumed, log=lambda _: None)
    assert result.resumed_from_step == 3
    assert sorted(resumed.metrics) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed.metrics[step]["train/loss"] == pytest.approx(
            straight.metrics[step]["train/loss"], abs=1e-6
        ), step
    assert result.initial_loss == pytest.approx(first.metrics[1]["train/loss"])

    again = train(interrupted, CPU, log=lambda _: None)  # finished: nothing to train, same report
    assert again.steps == 6 and again.resumed_from_step == 6
    assert again.initial_loss == result.initial_loss and again.final_loss == result.final_loss
    assert TrainResult.from_json(again.to_json()) == again


class _Planted:
    """A pickle that would run code when unpickled: it touches `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_rank_file_cannot_run_code_on_resume(tmp_path):
    recipe = build_recipe(tmp_path, {"train.steps": 4, "train.ckpt_every": 2})
    train(recipe, CPU, log=lambda _: None, stop_after=2)
    marker = tmp_path / "ran"
    torch.save({"loader": _Planted(marker)}, Path(recipe.checkpoint_dir()) / step_name(2) / "rank0.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        train(recipe, CPU, log=lambda _: None)
    assert not marker.exists()


def test_retraining_with_resume_false_replaces_a_longer_runs_checkpoints(tmp_path):
    every_2 = {"train.steps": 6, "train.ckpt_every": 2}
    train(build_recipe(tmp_path, every_2), CPU, log=lambda _: None)  # keeps steps 4 and 6
    restart = build_recipe(tmp_path, {**every_2, "train.resume": False})
    messages = []
    train(restart, CPU, log=messages.append, stop_after=2)
    assert any("steps [4, 6]" in m and "belong to an earlier run" in m for m in messages)
    store = checkpoint_store(restart)
    assert store.steps() == [2]  # its own save kept; the earlier run's later steps are not taken for its own
    assert train(build_recipe(tmp_path, every_2), CPU, log=lambda _: None).resumed_from_step == 2


def test_a_run_that_only_measures_saves_nothing(tmp_path):
    recipe = build_recipe(tmp_path, {"train.steps": 2, "train.ckpt_every": 1})
    result = train(recipe, CPU, log=lambda _: None, save=False)
    assert result.steps == 2 and result.checkpoint == ""
    saved = Path(recipe.checkpoint_dir())
    assert not saved.exists() or not any(p.is_file() for p in saved.rglob("*"))


def test_resume_when_an_encoder_never_saw_input(tmp_path):
    # text only: the vision and audio encoders get no gradient at all
    recipe = build_recipe(tmp_path, {"train.steps": 4, "train.ckpt_every": 2, "data.synthetic.mix": {"text": 1.0}})
    train(recipe, CPU, log=lambda _: None, stop_after=2)
    assert train(recipe, CPU, log=lambda _: None).resumed_from_step == 2


def test_activation_checkpointing_and_bf16_keep_the_numerics(tmp_path):
    plain, recomputed, bf16 = RecordingTracker(), RecordingTracker(), RecordingTracker()
    result = train(build_recipe(tmp_path / "a", {"train.steps": 3}), CPU, tracker=plain, log=lambda _: None)
    train(build_recipe(tmp_path / "b", {"train.steps": 3, "train.activation_checkpointing": True}), CPU,
          tracker=recomputed, log=lambda _: None)
    train(build_recipe(tmp_path / "c", {"train.steps": 3, "train.dtype": "bfloat16"}), CPU, tracker=bf16,
          log=lambda _: None)
    for step in (1, 2, 3):
        assert recomputed.metrics[step]["train/loss"] == pytest.approx(plain.metrics[step]["train/loss"], abs=1e-5)
        assert bf16.metrics[step]["train/loss"] == pytest.approx(plain.metrics[step]["train/loss"], rel=0.02)
    assert bf16.metrics[1]["train/loss"] != plain.metrics[1]["train/loss"]  # autocast really ran
    assert 0 < result.mfu_pct < 100 and 0 < plain.metrics[3]["perf/mfu_pct"] < 100
    assert result.mfu_peak == "cpu float32 matmul peak (measured here)"
    assert result.peak_mem_mb > 0 and plain.metrics[3]["perf/peak_mem_mb"] > 0


def test_moe_model_trains_with_its_load_balancing_loss(tmp_path):
    recipe = build_recipe(tmp_path, {"train.steps": 2, "model.flavor": "debug-moe"})
    tracker = RecordingTracker()
    train(recipe, CPU, tracker=tracker, log=lambda _: None)
    assert tracker.metrics[2]["train/aux_loss"] > 0


def test_changed_training_recipe_gets_its_own_checkpoints(tmp_path):
    base = build_recipe(tmp_path)
    operational = build_recipe(tmp_path, {"train.log_every": 3, "train.ckpt_every": 2})
    assert base.checkpoint_dir() == operational.checkpoint_dir()
    assert base.checkpoint_dir() != build_recipe(tmp_path, {"train.lr": 1e-3}).checkpoint_dir()


def test_interrupted_save_is_never_taken_for_a_checkpoint(tmp_path):
    recipe = build_recipe(tmp_path, {"train.steps": 2})
    train(recipe, CPU, log=lambda _: None)
    store = checkpoint_store(recipe)
    assert isinstance(store, LocalStore)
    half = store.local_dir(9)
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"partial")
    assert latest_checkpoint(store) == store.location(2)
    assert json.loads((store.local_dir(2) / MANIFEST).read_text())["step"] == 2
    with pytest.raises(CheckpointError, match=r"step_000009 has no manifest.json: an incomplete save, refusing"):
        evaluate_checkpoint(recipe, checkpoint=store.location(9))


def test_mfu_is_against_the_dense_peak_of_the_precision_in_use():
    from omni_core.common.catalog import GpuCatalog
    from omni_core.runtime import perf

    cuda, allowed = torch.device("cuda"), torch.backends.cuda.matmul.allow_tf32
    assert perf.matmul_precision(cuda, torch.bfloat16) == "bf16"
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert perf.matmul_precision(cuda, torch.float32) == "fp32"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert perf.matmul_precision(cuda, torch.float32) == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    catalog = GpuCatalog()
    assert catalog["a100"].peak_flops("tf32") == 156e12 and catalog["a100"].peak_flops("fp32") == 19.5e12
    assert catalog["v100"].peak_flops("tf32") == catalog["v100"].fp32_flops  # no TF32 tensor cores
