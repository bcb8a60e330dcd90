"""The shipped MLLM stages at world 2 on the quickstart's plan (two data-parallel ranks, the encoders in the
omni layout): alignment's image and audio losses fall, SFT's ranks start from alignment's saved weights (each
rank's shards of them) and its loss falls (one process: tests/unit/test_mllm_stages.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from omni_core.runtime.checkpoint import latest_checkpoint
from omni_core.runtime.ckpt_store import LocalStore
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.model_init import own_name
from omni_core.runtime.ranks import run_ranks
from omni_core.runtime.trainer import resume, set_up, train
from tests.helpers.hf_parts import write_parts
from tests.helpers.runtime import RecordingTracker
from tests.unit.test_mllm_stages import ALIGN, SFT, falls, losses, stage

WORLD = ("parallel.nproc=2",)


def _stages(rank: int, world: int, root: str, parts: dict[str, str]) -> dict[str, list[float]]:
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    out = Path(root)
    tracker = RecordingTracker()
    train(stage(ALIGN, out, parts, 16, "train.lr=0.02", *WORLD), info, tracker=tracker, log=lambda _: None)
    result = {key: losses(tracker, f"train/loss/{key}") for key in ("image", "audio")}
    checkpoint = latest_checkpoint(LocalStore(out / "mllm_align"))
    assert checkpoint is not None
    dcp_to_torch_save(checkpoint, out / f"saved{rank}.pt")
    saved = torch.load(out / f"saved{rank}.pt", weights_only=True)["model"]
    sft = stage(SFT, out, parts, 12, f"model.init_from={out / 'mllm_align'}",
                "train.lr_by_part={projectors: 0.01, llm: 0.003}", *WORLD)
    run = set_up(sft, info, lambda _: None)
    assert resume(run)[0] == 0
    for name, param in run.replica.parts[0].named_parameters():
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        assert torch.equal(whole.detach(), saved[own_name(name)]), name
    tracker = RecordingTracker()
    train(sft, info, tracker=tracker, log=lambda _: None)
    return {**result, "sft": losses(tracker)}


def test_alignment_then_sft_at_world_2(tmp_path: Path) -> None:
    parts = write_parts(tmp_path / "parts")
    results = run_ranks(_stages, 2, str(tmp_path), parts, timeout_s=300)[0]
    for key, series in results.items():
        print(key, [round(x, 3) for x in series])
        assert falls(series), (key, series)
