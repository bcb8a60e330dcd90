"""The shipped MLLM stages (recipes/mllm_align.yaml, recipes/mllm_sft.yaml) on tiny generated parts, in one
process: alignment trains the projectors only and the loss of the image and audio documents falls; SFT starts
from alignment's weights (weights only: step 0, fresh optimizer) with its per-part learning rates, and its
loss falls, and its checkpoint evaluates. Before any of that, `omni recipe check` names the folders a user fills."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from flows.cli import main
from omni_core.recipe import load_recipe
from omni_core.runtime.checkpoint import latest_checkpoint
from omni_core.runtime.ckpt_store import LocalStore
from omni_core.runtime.evaluate import evaluate_checkpoint
from omni_core.runtime.trainer import resume, set_up, train
from tests.helpers.hf_parts import write_parts
from tests.helpers.models import N_MELS, PATCH_SIZE
from tests.helpers.runtime import CPU, RecordingTracker

REPO = Path(__file__).resolve().parents[2]
ALIGN, SFT = REPO / "recipes" / "mllm_align.yaml", REPO / "recipes" / "mllm_sft.yaml"


def test_the_shipped_stages_name_the_folders_a_user_fills(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for recipe in (ALIGN, SFT):
        assert main(["recipe", "check", str(recipe)]) == 2
    err = capsys.readouterr().err
    for part in ("llm", "vision", "audio"):
        assert f"mllm_align.yaml:{27 + ('llm', 'vision', 'audio').index(part)}: model.pretrained.{part}: " \
               f"models/{part}: no such folder" in err, err
    assert "mllm_sft.yaml:14: model.init_from: runs/mllm_align/ckpt: no such checkpoint folder" in err, err


def stage(path: Path, root: Path, parts: dict[str, str], steps: int, *more: str):
    overrides = [f"model.pretrained.{part}={folder}" for part, folder in parts.items()]
    overrides += [f"experiment.output_dir={root}", "data.source=synthetic", f"data.path={root / 'data'}",
                  "data.format=auto", "data.media_root=''", "data.synthetic.num_samples=80", "data.seq_len=256",
                  f"data.patch_size={PATCH_SIZE}", f"data.n_mels={N_MELS}", "parallel.nproc=1",
                  f"train.steps={steps}", "train.warmup_steps=2", "train.log_every=1", "train.ckpt_every=0",
                  f"train.ckpt_dir={root / path.stem}", *more]
    return load_recipe(path, overrides)


def losses(tracker: RecordingTracker, key: str = "train/loss") -> list[float]:
    return [tracker.metrics[step][key] for step in sorted(tracker.metrics) if key in tracker.metrics[step]]


def falls(series: list[float]) -> bool:
    return sum(series[-4:]) / 4 < sum(series[:4]) / 4


def saved_weights(checkpoint: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(checkpoint, tmp_path / "saved.pt")
    return torch.load(tmp_path / "saved.pt", weights_only=True)["model"]


def test_alignment_then_sft_from_its_weights(tmp_path: Path) -> None:
    parts = write_parts(tmp_path / "parts")
    align = stage(ALIGN, tmp_path, parts, 16, "train.lr=0.02")
    tracker = RecordingTracker()
    train(align, CPU, tracker=tracker, log=lambda _: None)
    first = losses(tracker)
    for media in ("image", "audio"):  # what the projectors carry; the frozen LLM's text loss stays where it is
        series = losses(tracker, f"train/loss/{media}")
        print(f"alignment {media} losses", [round(x, 3) for x in series])
        assert falls(series), (media, series)

    checkpoint = latest_checkpoint(LocalStore(tmp_path / "mllm_align"))
    assert checkpoint is not None
    saved = saved_weights(checkpoint, tmp_path)
    sft = stage(SFT, tmp_path, parts, 12, f"model.init_from={tmp_path / 'mllm_align'}",
                "train.lr_by_part={projectors: 0.01, llm: 0.003}")
    run = set_up(sft, CPU, lambda _: None)
    start, _, resumed = resume(run)
    assert (start, resumed) == (0, None)  # weights only: no step, no checkpoint of its own
    model = run.replica.parts[0]
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    fresh = set_up(stage(SFT, tmp_path, parts, 12), CPU, lambda _: None).replica.parts[0].state_dict()
    assert not torch.equal(fresh["projectors.image.fc1.weight"], saved["projectors.image.fc1.weight"])
    lrs = {group["lr"] for group in run.optimizers.optimizers[0].param_groups}
    assert lrs == {0.01 * 0.5, 0.003 * 0.5}  # the two trained parts' peaks, in the first warmup step
    assert not run.optimizers.optimizers[0].state  # no optimizer state taken

    tracker = RecordingTracker()
    train(sft, CPU, tracker=tracker, log=lambda _: None)
    second = losses(tracker)
    print("sft losses", [round(x, 3) for x in second])
    assert falls(second), second
    assert second[0] < first[0]  # it starts where alignment left off, not from the fresh projectors
    report = evaluate_checkpoint(sft)  # the pretrained parts' architectures, built for the checkpoint
    assert report.step == 12 and math.isfinite(report.loss)
