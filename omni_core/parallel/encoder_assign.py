"""Where a step's encoder items are encoded (`assign`): long items split over an LSSP group, short ones on a
rank each, balanced on the models' FLOPs. Every rank computes the same placement from the same metadata, so
no rank ever tells another what to do.
"""

from __future__ import annotations

from omni_core.common.batch import video_tokens
from omni_core.common.plan import ParallelPlan
from omni_core.models.args import OmniModelArgs
from omni_core.models.flops import merged_grid
from omni_core.parallel.encoder_items import (
    ENCODER_OF,
    Item,
    Piece,
    audio_splits,
    is_long,
    item_cost,
    output_rows,
    split_units,
)
from omni_core.parallel.lssp import lssp_group_ranks, lssp_splits


def assign(
    items: list[Item], args: OmniModelArgs, plan: ParallelPlan, domains: dict[int, tuple[int, ...]] | None = None
) -> list[Piece]:
    """The same placement on every rank, in a canonical order (items by decreasing cost; ties by shard,
    micro-batch, modality, position). `domains`: the ranks that may encode a shard's items (default: every
    encoder rank).

    Long items first, each onto the least-loaded LSSP group inside its domain (any group when none fits in
    it), a chunk per member. Then short items by longest processing time onto the least-loaded of their own
    shard's ranks, which hold their inputs already (the domain's ranks when none does: `disaggregated`), and
    `_rebalance` moves them to other ranks of their domain only while that lowers the busiest rank's load: a
    batch the loaders balanced (`data.balance`) ships few inputs."""
    ranks = list(plan.encoder_ranks)
    load = dict.fromkeys(ranks, 0.0)
    keyed = sorted(items, key=lambda it: (-item_cost(it, args), it.shard, it.micro, it.modality, it.start))
    cost = {item: item_cost(item, args) for item in keyed}
    split: dict[Item, list[Piece]] = {}
    for item in keyed:
        spec = plan.encoders.spec(ENCODER_OF[item.modality])
        if not is_long(item, spec, args):
            continue
        domain = set(domains[item.shard]) if domains else set(ranks)
        groups = lssp_group_ranks(ranks, spec.lssp)
        groups = [g for g in groups if set(g) <= domain] or groups
        group = min(groups, key=lambda g: (max(load[r] for r in g), g[0]))
        split[item] = lssp_pieces(item, group, args)
        for rank in group:
            load[rank] += cost[item] / len(group)
    short = [item for item in keyed if item not in split]
    domain_of = {item: domains[item.shard] if domains else tuple(ranks) for item in short}
    home = {
        shard: [r for r in ranks if r < plan.llm_world_size and plan.data_rank(r) == shard]
        for shard in {item.shard for item in short}
    }
    placed = {}
    for item in short:
        rank = min(home[item.shard] or domain_of[item], key=lambda r: (load[r], r))
        load[rank] += cost[item]
        placed[item] = rank
    _rebalance(short, placed, load, cost, domain_of)
    pieces = []
    for item in keyed:
        pieces += split.get(item) or [Piece(item, placed[item], (0, output_rows(item, args)), (0, item.input_rows))]
    return pieces


def _rebalance(
    items: list[Item],
    placed: dict[Item, int],
    load: dict[int, float],
    cost: dict[Item, float],
    domain_of: dict[Item, tuple[int, ...]],
) -> None:
    """Moves from the busiest rank, one item at a time: the move that lowers the larger of its two ranks'
    loads the most, onto the least-loaded rank of the item's domain; stops when no move helps."""
    for _ in range(len(items)):
        busiest = max(load, key=lambda r: (load[r], -r))
        best, best_peak = None, load[busiest]
        for item in (it for it in items if placed[it] == busiest):
            target = min(domain_of[item], key=lambda r: (load[r], r))
            peak = max(load[busiest] - cost[item], load[target] + cost[item])
            if peak < best_peak:
                best, best_peak = (item, target), peak
        if best is None:
            return
        item, target = best
        load[busiest] -= cost[item]
        load[target] += cost[item]
        placed[item] = target


def lssp_pieces(item: Item, group: tuple[int, ...], args: OmniModelArgs) -> list[Piece]:
    """An item's chunks over an LSSP group (`split_units`). An image's chunk merges into whole rows of LLM
    tokens on its own; a video's chunk is a shorter video (its frames are separate attention documents, so its
    members need no exchange); a clip's members each take the whole clip's frames (the conv stem runs whole,
    see `AudioEncoder`) and a chunk of its subsampled tokens, whole pools (`audio_splits`)."""
    unit = split_units(item, args)[1]
    merge = args.spatial_merge
    if item.modality == "image":
        rows, cols = item.shape
        splits = lssp_splits(item.tokens, len(group), unit)
        m_cols = merged_grid(rows, cols, merge)[1]
        out_rows = [-(-(s // cols) // merge) * m_cols for s in splits]
        inputs = list(splits)
    elif item.modality == "video":
        frames, rows, cols = item.shape
        splits = lssp_splits(frames, len(group), unit)  # frames per member
        out_rows = [video_tokens(f, rows, cols, args.temporal_merge, merge) for f in splits]
        inputs = [f * rows * cols for f in splits]
    else:
        splits, out_rows = audio_splits(item, len(group), args)
        inputs = [0] * len(splits)
    pieces, first, row = [], 0, 0
    for rank, count, out in zip(group, inputs, out_rows, strict=True):
        span = (first, first + count) if item.modality != "audio" else (0, item.input_rows)
        pieces.append(Piece(item, rank, (row, row + out), span, group, tuple(splits)))
        first, row = first + count, row + out
    return pieces
