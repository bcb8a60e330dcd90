"""The shipped MLLM stages at world 2 on the quickstart's plan (two data-parallel ranks), the encoders in the
omni and in the coupled layout, on LLaVA-format conversations about generated images: alignment's image loss
falls; SFT's ranks start from alignment's saved weights (each rank's shards of them); the batches SFT trains on
carry loss on the assistant replies alone; its loss falls (one process, with audio: tests/unit/test_mllm_stages.py)."""

from __future__ import annotations

import json
from itertools import groupby
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from omni_core.common.tokenizer import HFTokenizer
from omni_core.data.packing import IGNORE
from omni_core.runtime.checkpoint import latest_checkpoint
from omni_core.runtime.ckpt_store import LocalStore
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.model_init import own_name
from omni_core.runtime.ranks import run_ranks
from omni_core.runtime.trainer import resume, set_up, train
from tests.helpers.conversations import write_llava
from tests.helpers.hf_parts import write_llm, write_vision
from tests.helpers.runtime import RecordingTracker
from tests.unit.test_mllm_stages import ALIGN, SFT, falls, losses, stage


def conversation_stage(path: Path, root: Path, parts: dict[str, str], steps: int, layout: str, *more: str):
    """`stage` on the LLaVA records under root/llava (their images beside them), without an audio encoder."""
    data = root / "llava"
    return stage(
        path,
        root,
        parts,
        steps,
        "model.pretrained.audio=null",
        "data.source=jsonl",
        f"data.path={data / 'llava.json'}",
        f"data.media_root={data}",
        "data.format=conversation",
        "parallel.nproc=2",
        f"parallel.encoders.layout={layout}",
        *more,
    )


def trained_texts(batch, tokenizer: HFTokenizer) -> list[str]:
    """Each run of consecutive targets in the batch, decoded without special tokens."""
    labels = batch.labels.tolist()
    runs = [list(run) for target, run in groupby(labels, key=lambda t: t != IGNORE) if target]
    return [tokenizer.decode(run, skip_special_tokens=True).strip() for run in runs]


def _stages(rank: int, world: int, root: str, parts: dict[str, str], layout: str) -> dict[str, list]:
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    out = Path(root)
    tracker = RecordingTracker()
    train(conversation_stage(ALIGN, out, parts, 16, layout, "train.lr=0.02"), info, tracker=tracker, log=lambda _: None)
    result: dict[str, list] = {"image": losses(tracker, "train/loss/image")}
    checkpoint = latest_checkpoint(LocalStore(out / "mllm_align"))
    assert checkpoint is not None
    dcp_to_torch_save(checkpoint, out / f"saved{rank}.pt")
    saved = torch.load(out / f"saved{rank}.pt", weights_only=True)["model"]
    sft = conversation_stage(
        SFT,
        out,
        parts,
        12,
        layout,
        f"model.init_from={out / 'mllm_align'}",
        "train.lr_by_part={projectors: 0.01, llm: 0.003}",
    )
    run = set_up(sft, info, lambda _: None)
    assert resume(run)[0] == 0
    for name, param in run.replica.parts[0].named_parameters():
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        assert torch.equal(whole.detach(), saved[own_name(name)]), name
    assert run.loader is not None
    result["trained"] = trained_texts(next(iter(run.loader)), HFTokenizer.from_pretrained(parts["llm"]))
    tracker = RecordingTracker()
    train(sft, info, tracker=tracker, log=lambda _: None)
    return {**result, "sft": losses(tracker)}


@pytest.mark.parametrize("layout", ["omni", "coupled"])
def test_alignment_then_sft_on_conversations_at_world_2(tmp_path: Path, layout: str) -> None:
    parts = {
        "llm": str(write_llm(tmp_path / "parts" / "llm")),
        "vision": str(write_vision(tmp_path / "parts" / "vision")),
    }
    records = json.loads(write_llava(tmp_path / "llava", 32)["json"].read_text())
    replies = {turn["value"] for r in records for turn in r["conversations"] if turn["from"] == "gpt"}
    for rank, results in enumerate(run_ranks(_stages, 2, str(tmp_path), parts, layout, timeout_s=400)):
        trained = results.pop("trained")
        assert trained and set(trained) <= replies, (rank, trained)  # no prompt token is a target
        for key, series in results.items():
            print(layout, rank, key, [round(x, 3) for x in series])
            assert falls(series), (layout, rank, key, series)
