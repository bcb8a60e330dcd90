"""Pretrained parts loaded shard by shard: at world 2 under FSDP (dp2, the encoders in the quickstart's omni
layout and coupled) and TP (dp1-tp2), at world 4 under FSDP over TP (dp2-tp2, whose FSDP shards stride TP's
rows), each rank's local tensors are the slices its plan gives it of the files' tensors, cut by DTensor itself
from the whole file, and the whole parameters are the files'. Each rank's peak host memory (RSS) is printed:
the benchmark measures it at scale."""

from __future__ import annotations

import resource

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from omni_core.common.plan import ParallelPlan
from omni_core.models.hf_import import load_pretrained
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.model_init import own_name
from omni_core.runtime.ranks import run_ranks
from omni_core.runtime.replica import build_replica
from tests.helpers.hf_parts import with_added_rows, write_parts
from tests.helpers.recipes import build_recipe

PLANS = {2: ("dp2+omni", "dp2", "dp1-tp2"), 4: ("dp2-tp2",)}  # world -> plans; FSDP over TP strides its rows


def _worker(rank: int, world: int, root: str, parts: dict[str, str]) -> dict[str, tuple[int, int, int]]:
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    files = {part: load_pretrained(folder, part)[0].state_dict() for part, folder in parts.items()}
    results = {}
    for name in PLANS[world]:
        recipe = build_recipe(root, {"model.pretrained": parts})
        replica = build_replica(recipe, ParallelPlan.parse(name), info, torch.float32)
        sharded = compared = 0
        for part in replica.parts:
            for param_name, param in part.named_parameters():
                part_name, tensor_name = own_name(param_name).split(".", 1)
                if part_name not in files:
                    continue
                stored = with_added_rows(files[part_name][tensor_name], param.shape)
                if isinstance(param, DTensor):
                    mine = distribute_tensor(stored, param.device_mesh, param.placements, src_data_rank=None)
                    torch.testing.assert_close(param.to_local(), mine.to_local(), rtol=0, atol=1e-7)
                    torch.testing.assert_close(param.full_tensor(), stored, rtol=0, atol=1e-7)
                    sharded += param.to_local().numel() < stored.numel()
                else:
                    torch.testing.assert_close(param.detach(), stored, rtol=0, atol=1e-7)
                compared += 1
        if replica.meshes is not None:
            replica.meshes.release()
        results[name] = (sharded, compared, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return results


@pytest.mark.parametrize("world", sorted(PLANS))
def test_each_rank_holds_its_slices_of_the_files(tmp_path, world):
    parts = write_parts(tmp_path / "parts")
    per_rank = run_ranks(_worker, world, str(tmp_path), parts)
    for name in PLANS[world]:
        for rank, results in enumerate(per_rank):
            sharded, compared, peak_kib = results[name]
            print(f"{name} rank {rank}: {compared} pretrained tensors, {sharded} sharded; "
                  f"peak RSS {peak_kib / 1024:.0f} MiB")
            assert compared > 0 and sharded > 0, name
