"""LSSP (omni_core/parallel/lssp.py): one image or audio clip split over a group equals the one-rank encoder.

Every rank runs the one-rank reference itself (same seed), then its chunk through `SequenceShard`. The parent
concatenates the members' output and input-gradient chunks in rank order and compares them with the reference;
parameter gradients are summed over the group on the ranks. Checks are batched into one launch per world size.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from omni_core.models.audio import AudioEncoder
from omni_core.models.flavors import get_flavor
from omni_core.models.vision import VisionEncoder
from omni_core.parallel.encoder_items import Item, audio_splits
from omni_core.parallel.lssp import SequenceShard, lssp_splits
from omni_core.runtime.ranks import run_ranks
from tests.helpers.models import N_MELS, PATCH_DIM, PATCH_SIZE

MERGE = 2
DEBUG = get_flavor("debug", patch_size=PATCH_SIZE, n_mels=N_MELS)


def _compare(encoder, inputs, counts, n_tokens, align, group, seed, splits=None):
    """Reference and sharded run of `encoder(inputs, counts[, shard])` under a fixed random linear loss.

    Vision shards its input (the patches); audio passes the whole clip to every member (the conv stem), its
    `splits` (`encoder_items.audio_splits`) whole pools of tokens, each member's output its chunk's pools."""
    full = inputs.clone().requires_grad_()
    reference = encoder(full, counts)
    weight = torch.randn(reference.shape[0], encoder.args.dim, generator=torch.Generator().manual_seed(seed))
    (reference * weight).sum().backward()
    reference_grads = {name: p.grad.clone() for name, p in encoder.named_parameters()}
    encoder.zero_grad()

    shard = SequenceShard(group, splits or lssp_splits(n_tokens, dist.get_world_size(group), align))
    chunk = slice(shard.offset, shard.offset + shard.length)
    rows = [s // getattr(encoder.args, "pool", 1) for s in shard.splits]
    out_chunk = slice(sum(rows[: shard.rank]), sum(rows[: shard.rank + 1]))
    sharded_input = isinstance(encoder, VisionEncoder)
    local = (inputs[chunk] if sharded_input else inputs).clone().requires_grad_()
    out = encoder(local, counts, shard)
    (out * weight[out_chunk]).sum().backward()
    grad_errors = {}
    for name, p in encoder.named_parameters():
        dist.all_reduce(p.grad, group=group)
        grad_errors[name] = _relative_error(p.grad, reference_grads[name])
    return {"splits": shard.splits, "rows": rows, "out": out.detach(), "reference": reference.detach(),
            "sharded_input": sharded_input,
            "input_grad": local.grad, "reference_input_grad": full.grad, "param_grad_error": max(grad_errors.values())}


def _relative_error(a, b):
    """Max abs difference over the reference's largest entry (at least 1): gradients reach ~20, where fp32
    summed in another order differs by a few 1e-6."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()


def _vision(group, rows, cols, pos_embed="factorized", seed=0):
    torch.manual_seed(seed)
    encoder = VisionEncoder(replace(DEBUG.vision, pos_embed=pos_embed))
    patches = torch.randn(rows * cols, PATCH_DIM, generator=torch.Generator().manual_seed(seed))
    return _compare(encoder, patches, torch.tensor([[rows, cols]]), rows * cols, MERGE * cols, group, seed)


def _audio(group, frames, seed=0, pool=1):
    torch.manual_seed(seed)
    args = replace(DEBUG, audio=replace(DEBUG.audio, pool=pool))
    encoder = AudioEncoder(args.audio)
    mels = torch.randn(frames, N_MELS, generator=torch.Generator().manual_seed(seed))
    splits = audio_splits(Item("audio", 0, 0, (frames,), 0, 0), dist.get_world_size(group), args)[0]
    return _compare(encoder, mels, torch.tensor([frames]), frames // 2, 1, group, seed, splits)


def _world2(rank, world):
    group = dist.group.WORLD
    results = {
        "vision 8x6, 4 merge rows": _vision(group, 8, 6),
        "vision 6x6, 3 merge rows": _vision(group, 6, 6),
        "vision 7x6 absolute positions, partial last merge row": _vision(group, 7, 6, "absolute"),
        "audio 40 frames": _audio(group, 40),
        "audio 42 frames, 21 tokens": _audio(group, 42),
        "audio 42 frames, pool 2": _audio(group, 42, pool=2),
        "audio 46 frames, pool 2, a partial pool": _audio(group, 46, pool=2),
    }
    encoder = VisionEncoder(replace(DEBUG.vision, dim=48, n_heads=3))
    shard = SequenceShard(group, lssp_splits(36, world, MERGE * 6))
    try:
        encoder(torch.zeros(shard.length, PATCH_DIM), torch.tensor([[6, 6]]), shard)
    except ValueError as error:
        results["3 heads"] = str(error)
    return results


def _world4(rank, world):
    # Two LSSP groups {0, 1} and {2, 3} on different items at once: members are group ranks, not global ones.
    subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = _vision(subgroups[0], 6, 6) if rank < 2 else _audio(subgroups[1], 42, seed=1)
    return {
        "vision 8x6 over 4": _vision(dist.group.WORLD, 8, 6),
        "audio 40 frames over 4": _audio(dist.group.WORLD, 40),
        "pair of groups": pair,
    }


def _assert_matches(case, members, tolerance=1e-5):
    """The members' results of one case, in group rank order: concatenated chunks equal the reference output,
    and parameter gradients summed over the group its gradients. Input gradients: vision's patch gradient
    chunks are the reference's rows; audio's whole-clip mel gradients sum to the reference's. Gradients are
    compared relative to their largest entry, outputs (layer-normed) absolutely."""
    lengths = [len(m["out"]) for m in members]
    assert lengths == members[0]["rows"], f"{case}: chunk lengths {lengths} are not the splits' rows"
    first = members[0]
    input_grads = [m["input_grad"] for m in members]
    input_grad = torch.cat(input_grads) if first["sharded_input"] else torch.stack(input_grads).sum(0)
    errors = {
        "out": (torch.cat([m["out"] for m in members]) - first["reference"]).abs().max().item(),
        "param grads": max(m["param_grad_error"] for m in members),
        "input grads": _relative_error(input_grad, first["reference_input_grad"]),
    }
    assert all(error < tolerance for error in errors.values()), f"{case}: {errors}"  # NaN fails


def test_lssp_matches_one_rank_encoders_over_2():
    results = run_ranks(_world2, 2)
    assert results[0]["vision 6x6, 3 merge rows"]["splits"] == [12, 24]
    assert results[0]["vision 7x6 absolute positions, partial last merge row"]["splits"] == [24, 18]
    assert results[0]["audio 42 frames, 21 tokens"]["splits"] == [10, 11]
    assert results[0]["audio 46 frames, pool 2, a partial pool"]["splits"] == [10, 13]  # 5 + 6 of 11 pools
    assert all("3 heads do not divide by the LSSP group size 2" in cases.pop("3 heads") for cases in results)
    for case in results[0]:
        _assert_matches(case, [cases[case] for cases in results])


def test_lssp_matches_one_rank_encoders_over_4():
    results = run_ranks(_world4, 4)
    assert results[0]["vision 8x6 over 4"]["splits"] == [12] * 4
    for case in ("vision 8x6 over 4", "audio 40 frames over 4"):
        _assert_matches(case, [cases[case] for cases in results])
    for pair in (results[:2], results[2:]):
        _assert_matches("pair of groups", [cases["pair of groups"] for cases in pair])
