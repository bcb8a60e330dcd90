"""The `omni` layout's placement (`parallel.encoder_assign.assign`): computed identically on every rank from the
items' metadata alone, so it must be deterministic, balanced by cost, and split only what is long."""

from __future__ import annotations

from omni_core.common.plan import ParallelPlan
from omni_core.models.flavors import get_flavor
from omni_core.parallel.encoder_assign import assign
from omni_core.parallel.encoder_items import Item, item_cost, output_rows

ARGS = get_flavor("debug", patch_size=8, n_mels=32)


def image(shard: int, rows: int, cols: int, start: int = 0) -> Item:
    return Item("image", shard, 0, (rows, cols), start, 0)


def loads(pieces, world: int) -> list[float]:
    load = [0.0] * world
    for piece in pieces:
        share = 1 / len(piece.group) if piece.group else 1
        load[piece.rank] += item_cost(piece.item, ARGS) * share
    return load


def test_longest_processing_time_balances_every_shards_items_over_the_world():
    """Shard 0 holds all the large images: they are spread over both ranks anyway."""
    items = [image(0, 8, 8, start=i * 64) for i in range(4)] + [image(1, 2, 2)]
    pieces = assign(items, ARGS, ParallelPlan.parse("dp2+omni"))
    assert {p.rank for p in pieces if p.item.shape == (8, 8)} == {0, 1}
    low, high = sorted(loads(pieces, 2))
    assert high - low <= item_cost(image(1, 2, 2), ARGS)
    assert assign(list(reversed(items)), ARGS, ParallelPlan.parse("dp2+omni")) == pieces  # order-free


def test_only_items_over_the_threshold_split_over_the_lssp_group():
    items = [image(0, 8, 6), image(0, 2, 2, start=100)]
    pieces = assign(items, ARGS, ParallelPlan.parse("dp2+omni.v-sp2-t40"))
    split = [p for p in pieces if p.item.shape == (8, 6)]
    assert [(p.rank, p.rows) for p in split] == [(0, (0, 24)), (1, (24, 48))]
    assert [p.group for p in pieces if p.item.shape == (2, 2)] == [()]
    assert sum(p.rows[1] - p.rows[0] for p in split) == output_rows(items[0], ARGS)


def test_a_video_splits_into_whole_frame_groups_and_a_small_one_runs_whole():
    video = Item("video", 0, 0, (6, 4, 4), 0, 0)
    pieces = assign([video], ARGS, ParallelPlan.parse("dp2+omni.v-sp2-t8"))
    assert [p.inputs for p in pieces] == [(0, 32), (32, 96)]  # 2 and 4 frames of 16 patches
    assert [p.rows for p in pieces] == [(0, 16), (16, 48)]  # temporal merge 2: 1 and 2 merged frames
    short = Item("video", 0, 0, (2, 4, 4), 0, 0)  # one frame group: nothing to split
    assert [p.group for p in assign([short], ARGS, ParallelPlan.parse("dp2+omni.v-sp2-t8"))] == [()]


def test_a_balancing_domain_keeps_short_items_on_their_shards_ranks():
    """`data.balance.policy=none` gives each shard a domain of its own ranks: nothing moves, whatever the loads;
    a long item still splits over an LSSP group (none lies inside a one-rank domain)."""
    items = [image(0, 8, 8, start=i * 64) for i in range(4)] + [image(1, 2, 2)]
    own = {0: (0,), 1: (1,)}
    pieces = assign(items, ARGS, ParallelPlan.parse("dp2+omni"), own)
    assert all(p.rank == p.item.shard for p in pieces)
    long_item = assign([image(0, 8, 6)], ARGS, ParallelPlan.parse("dp2+omni.v-sp2-t40"), own)
    assert [p.rank for p in long_item] == [0, 1]


def test_a_pooled_clip_splits_into_whole_pools_and_its_rows_are_the_pools():
    """model.audio_pool 2: 23 encoder tokens are 11 pools over the LSSP pair, the partial pool with the last
    member; each member's rows are its chunk's pools, together the clip's placeholders."""
    from dataclasses import replace

    pooled = replace(ARGS, audio=replace(ARGS.audio, pool=2))
    clip = Item("audio", 0, 0, (46,), 0, 0)
    pieces = assign([clip], pooled, ParallelPlan.parse("dp2+omni.a-sp2-t8"))
    assert [p.splits for p in pieces] == [(10, 13)] * 2
    assert [p.rows for p in pieces] == [(0, 5), (5, 11)]
    assert output_rows(clip, pooled) == 11 and output_rows(clip, ARGS) == 23
