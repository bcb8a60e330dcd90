"""The towers' export options under the `omni` encoder layout on gloo, against one process (the coupled
encoders): Qwen2-Audio's tower and projector (`model.audio_pool: 2`, `model.audio_projector: linear`), clips split
over an LSSP pair in whole pools; and LLaVA's feature layer (`model.vision_final_norm: false`), which the omni
layout's encoder calls end with as the tower's own forward does."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from omni_core.common.batch import PackedBatch
from omni_core.common.plan import ParallelPlan
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.ranks import run_ranks
from omni_core.runtime.replica import build_replica
from omni_core.runtime.step import train_step
from tests.helpers.models import N_MELS, make_batch
from tests.helpers.plans import CapturingOptimizers
from tests.helpers.recipes import build_recipe
from tests.ranks.test_encoder_layouts_ranks import PARTIAL
from tests.ranks.test_encoder_layouts_ranks import SHARDS as IMAGE_SHARDS


def pooled(batch: PackedBatch, seed: int) -> PackedBatch:
    """`batch` with each clip's frames doubled (fresh mels): its h // 2 placeholders are the 2h frames' pooled
    count, (2h // 2) // 2."""
    frames = batch.audio_frames * 2
    mels = torch.randn(int(frames.sum()), N_MELS, generator=torch.Generator().manual_seed(seed))
    return replace(batch, audio_mels=mels, audio_frames=frames, layout=None)


SHARDS = [  # 46 frames: 23 encoder tokens, 11 pools (a partial one); 40 frames: 20 tokens, 10 pools
    pooled(make_batch([[("text", 5), ("audio", 23), ("text", 4)], [("audio", 20), ("text", 9)]], seed=1), seed=3),
    make_batch([[("text", 30)], [("text", 21)]], seed=2),
]


QWEN2_AUDIO = {"model.audio_pool": 2, "model.audio_projector": "linear"}


def _worker(rank: int, world: int, plan_name: str, options: dict, shards: list[PackedBatch]) -> tuple[float, dict]:
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    plan = ParallelPlan.parse(plan_name)
    recipe = build_recipe(overrides={**PARTIAL, **options, "train.grad_accum": len(shards) // plan.dp})
    replica = build_replica(recipe, plan, info, torch.float32)
    optimizers = CapturingOptimizers(replica.parts, recipe)
    batches = shards[plan.data_rank(rank)::plan.dp] if replica.loads_data else []
    loss = train_step(replica, optimizers, batches, grad_clip=0.0).metrics["loss"]
    return loss, optimizers.grads


def _trains_like_one_process(plan: str, options: dict, shards: list[PackedBatch]) -> dict:
    (ref_loss, ref_grads), = run_ranks(_worker, 1, "dp1", options, shards)
    merged: dict[str, torch.Tensor] = {}
    for loss, grads in run_ranks(_worker, 2, plan, options, shards):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        merged.update(grads)
    assert merged.keys() == ref_grads.keys()
    for name, expected in ref_grads.items():
        torch.testing.assert_close(merged[name], expected, rtol=1e-3, atol=1e-6, msg=name)
    return ref_grads


def test_pooled_clips_split_over_lssp_train_like_one_process():
    grads = _trains_like_one_process("dp2+omni.a-sp2-t8", QWEN2_AUDIO, SHARDS)
    assert "projectors.audio.linear.weight" in grads


def test_llavas_feature_layer_trains_like_one_process():
    """The image projector reads the last block's output: the omni layout's calls skip the final norm too."""
    _trains_like_one_process("dp2+omni", {"model.vision_final_norm": False}, IMAGE_SHARDS)
