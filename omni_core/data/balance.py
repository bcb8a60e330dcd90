"""Workload balancing in the loaders: MegaScale-Omni's decentralized grouped reordering (DESIGN.md §3).

Data ranks form groups of `group_size` consecutive ranks (`balance_group_size`: by default the data shards of
one node). The members of a group read the same stream of sample *metadata* (the group's share of the source)
and pool a window of it; each member computes the same deterministic placement of the window onto the group's
(data rank, sequence) bins (`place`), keeps the sequences of its own rank, and only then reads and decodes their
sample bytes. There is no coordinator and nothing crosses groups: what a member sees is its group's metadata,
so its traffic depends on the group size, not on the world's. `global` is the same with one group of all data
ranks (OrchMLLM-like); `none` packs each rank's own stream by tokens alone (`packing.BatchPacker`).

The placement balances each rank's predicted work: a sample's encoder plus LLM training FLOPs, the models'
own counts (`flops.FlopModel`, which the profile and the estimator read too). Under `coupled` that sum is what
a rank runs; under `omni` the encoders' share is balanced again at step time, over the group's ranks
(`parallel.encoders.EncoderStep`). Groups never see each other: each takes its window's costliest samples
first, so groups whose windows differ end up with different loads (what the simulated benchmark measures).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from types import SimpleNamespace
from typing import Any, TypeVar

import numpy as np

from omni_core.data.balance_groups import balance_group_size
from omni_core.data.flops import FlopModel
from omni_core.data.packing import OVERDUE, BatchPacker
from omni_core.recipe.schema import Recipe

POLICIES = ("none", "grouped", "global")
# metadata a member reads per sample: its modality, ref, ordinal and the sizes sample.SIZE_FIELDS (int64 each)
METADATA_BYTES = 8 * 16
COST_FIELDS = ("tokens", "vision_tokens", "vision_sq", "image_llm", "video_llm", "audio_frames", "audio_sq")
POLISH_ROUNDS = 64  # swaps tried after the greedy placement
SEARCH = 16  # ranks an item may pass over for lack of room before it waits (bounds a placement's time)

S = TypeVar("S")


@dataclass(frozen=True)
class SampleCost:
    """Predicted training cost of samples on the rank that holds them, as (encoder, LLM) FLOPs each: the
    encoders and projectors on its images, frames and clips, and the LLM on its tokens as one document."""

    flops: FlopModel

    @classmethod
    def for_flavor(cls, flavor: str, *, patch_size: int, n_mels: int) -> SampleCost:
        return cls(FlopModel.for_flavor(flavor, patch_size=patch_size, n_mels=n_mels))

    @classmethod
    def for_recipe(cls, recipe: Recipe) -> SampleCost:
        return cls(FlopModel.for_recipe(recipe))

    def of_records(self, records: Sequence[Any]) -> np.ndarray:
        """[n, 2] costs of records (`sources.Record`)."""
        return self.of(
            SimpleNamespace(
                **{name: np.array([getattr(r, name) for r in records], dtype=np.int64) for name in COST_FIELDS}
            )
        )

    def of(self, sizes: Any) -> np.ndarray:
        """[n, 2] costs of samples given as columns (`sources.Sizes`) or one record's fields (`Record`)."""
        f = self.flops
        encoder = f.encoder(
            sizes.vision_tokens,
            sizes.vision_sq,
            np.add(sizes.image_llm, sizes.video_llm),
            sizes.audio_frames,
            sizes.audio_sq,
        )
        return np.stack([np.atleast_1d(encoder), np.atleast_1d(f.llm(sizes.tokens))], axis=-1).reshape(-1, 2)


@dataclass(frozen=True)
class Balance:
    """A loader's balancing: its policy, the group it is `member` of (`members` data ranks), the batches one
    placement fills per member (an optimizer step's micro-batches) of `micro_batch` sequences, and the cost
    model."""

    policy: str = "none"
    members: int = 1
    member: int = 0
    step_batches: int = 1
    cost: SampleCost | None = None
    micro_batch: int = 1

    @property
    def placed_batches(self) -> int:
        """Batches one pack fills: `step_batches` when balancing, else one (plain packing)."""
        return 1 if self.policy == "none" else self.step_batches

    @property
    def readers(self) -> int:
        """Data ranks that read one stream: the group's members when balancing, else each rank its own."""
        return 1 if self.policy == "none" else self.members

    @property
    def identity(self) -> str:
        """What a saved loader position must match: the group, and the sequences one placement fills per member,
        however they split into micro-batches (a position saved at a step's end has nothing queued), so a
        re-plan from 2 micro-batches of 1 to 1 of 2 keeps the data order."""
        if self.policy == "none":
            return "none"
        return f"{self.policy}/{self.members}/{self.step_batches * self.micro_batch}seq"


def balance_for(recipe: Recipe, data_rank: int, dp: int, shards_per_node: int) -> Balance:
    """The training loader's balancing under the recipe (`data.balance`), for data rank `data_rank` of `dp`."""
    cfg = recipe.data
    members = balance_group_size(cfg.balance.policy, cfg.balance.group_size, dp, shards_per_node)
    cost = SampleCost.for_recipe(recipe)
    return Balance(cfg.balance.policy, members, data_rank % members, recipe.train.grad_accum, cost, cfg.micro_batch)


def place(
    tokens: Sequence[int], costs: np.ndarray, waits: Sequence[int], ranks: int, bins: int, capacity: int
) -> list[tuple[int, int] | None]:
    """Where each window item goes: (rank, sequence) or None (it waits). The same on every caller.

    Longest processing time first under the token budget: items overdue (passed over OVERDUE times) first,
    then by decreasing cost (encoder + LLM), each onto the least-loaded rank that has a sequence it fits in
    (the emptiest of that rank's sequences, so that its micro-batches stay even), looking past at most SEARCH
    ranks without room. The window holds more tokens than a batch: the cheapest items are the ones left to
    wait. Then `_polish` swaps pairs between the most and the least loaded rank. Ties go to the earlier item
    and the lower rank."""
    total = costs.sum(axis=1) if len(costs) else np.zeros(0)
    order = sorted(range(len(tokens)), key=lambda i: (waits[i] < OVERDUE, -total[i], i))
    loads = [0.0] * ranks
    room = [[capacity] * bins for _ in range(ranks)]
    most = [capacity] * ranks  # each rank's largest room
    heap = [(0.0, r) for r in range(ranks)]  # (load, rank) of ranks that may still take an item
    out: list[tuple[int, int] | None] = [None] * len(tokens)
    smallest = min(tokens, default=0)
    for i in order:
        if not heap:
            break
        skipped: list[tuple[float, int]] = []
        while heap and most[heap[0][1]] < tokens[i] and len(skipped) < SEARCH:
            skipped.append(heapq.heappop(heap))
        if heap and most[heap[0][1]] >= tokens[i]:
            _, rank = heapq.heappop(heap)
            seq = max(range(bins), key=lambda b: (room[rank][b], -b))
            room[rank][seq] -= tokens[i]
            most[rank] = max(room[rank])
            loads[rank] += float(total[i])
            out[i] = (rank, seq)
            skipped.append((loads[rank], rank))
        for entry in skipped:
            if most[entry[1]] >= smallest:  # a full rank leaves the heap for good
                heapq.heappush(heap, entry)
    _polish(out, tokens, total, loads, room)
    return out


def _polish(
    out: list[tuple[int, int] | None],
    tokens: Sequence[int],
    total: np.ndarray,
    loads: list[float],
    room: list[list[int]],
    rounds: int = POLISH_ROUNDS,
) -> None:
    """Swaps that LPT's greedy order missed: while some pair of one item of the most loaded rank and one of
    the least loaded (sizes permitting, in their sequences) narrows the gap between them, swap the best pair."""
    if len(loads) < 2:
        return
    held: list[list[int]] = [[] for _ in loads]
    for i, spot in enumerate(out):
        if spot is not None:
            held[spot[0]].append(i)
    for _ in range(rounds):
        hi, lo = int(np.argmax(loads)), int(np.argmin(loads))
        gap = loads[hi] - loads[lo]
        a, b = held[hi], held[lo]
        if not a or not b or gap <= 0:
            return
        ta, tb = np.array([tokens[i] for i in a]), np.array([tokens[i] for i in b])
        ra = np.array([room[hi][_spot(out, i)[1]] for i in a]) + ta  # room each item's sequence has without it
        rb = np.array([room[lo][_spot(out, i)[1]] for i in b]) + tb
        moved = total[a][:, None] - total[b][None, :]  # load that leaves hi per swap
        fits = (tb[None, :] <= ra[:, None]) & (ta[:, None] <= rb[None, :]) & (moved > 0) & (moved < gap)
        if not fits.any():
            return
        after = np.where(fits, np.abs(gap - 2 * moved), np.inf)
        x, y = np.unravel_index(int(np.argmin(after)), after.shape)
        i, j = a[x], b[y]
        (_, si), (_, sj) = _spot(out, i), _spot(out, j)
        room[hi][si] += tokens[i] - tokens[j]
        room[lo][sj] += tokens[j] - tokens[i]
        loads[hi] -= float(moved[x, y])
        loads[lo] += float(moved[x, y])
        out[i], out[j] = (lo, sj), (hi, si)
        a[x], b[y] = j, i


def _spot(out: list[tuple[int, int] | None], i: int) -> tuple[int, int]:
    """Where item `i` sits, (rank, sequence): `_polish` only moves items that were placed."""
    spot = out[i]
    assert spot is not None
    return spot


class GroupPacker(BatchPacker[S]):
    """A group member's packer: its pool is the group's window (a `BatchPacker` pool of `members` x
    `sequences` sequences' worth), a batch places it over every member's `sequences` sequences (`place`) and
    returns this member's.

    After a pack, `costs` and `filled` are every member's predicted (encoder, LLM) cost and tokens of what it
    placed, `balance_s` the seconds the placement took."""

    def __init__(
        self,
        members: int,
        member: int,
        sequences: int,
        capacity: int,
        lookahead: float,
        costs_of: Callable[[list[S]], np.ndarray],
        size: Callable[[S], int] = attrgetter("tokens"),
    ) -> None:
        super().__init__(members * sequences, capacity, lookahead, size)
        self.members, self.member, self.sequences, self.costs_of = members, member, sequences, costs_of
        self.costs, self.filled = np.zeros((members, 2)), np.zeros(members)
        self.balance_s = 0.0

    def pack(self) -> list[list[S]]:
        start = time.perf_counter()
        costs = np.asarray(self.costs_of(self.items), dtype=np.float64).reshape(-1, 2)
        where = place(self.sizes, costs, self.waits, self.members, self.sequences, self.capacity)
        self.costs, self.filled = np.zeros((self.members, 2)), np.zeros(self.members)
        mine: list[list[S]] = [[] for _ in range(self.sequences)]
        keep = []
        for i, spot in enumerate(where):
            if spot is None:
                keep.append(i)
                continue
            self.costs[spot[0]] += costs[i]
            self.filled[spot[0]] += self.sizes[i]
            if spot[0] == self.member:
                mine[spot[1]].append(self.items[i])
        self.items = [self.items[i] for i in keep]
        self.sizes = [self.sizes[i] for i in keep]
        self.waits = [self.waits[i] + 1 for i in keep]
        self.pool_tokens = sum(self.sizes)
        self.balance_s = time.perf_counter() - start
        return mine


def make_packer(
    policy: str, members: int, member: int, bins: int, capacity: int, lookahead: float, cost: SampleCost | None
) -> BatchPacker | GroupPacker:
    if policy == "none":
        return BatchPacker(bins, capacity, lookahead)
    if cost is None:
        raise ValueError(f"data.balance.policy={policy} needs the model's per-sample cost (SampleCost)")
    return GroupPacker(members, member, bins, capacity, lookahead, cost.of_records)


def simulate(
    tokens: np.ndarray,
    costs: np.ndarray,
    policy: str,
    ranks: int,
    group: int,
    bins: int,
    capacity: int,
    lookahead: float,
    steps: int,
) -> dict[str, float]:
    """What `steps` steps of `ranks` data ranks would see under a policy, from samples' tokens and [n, 2] costs
    alone (a stream in order: the profile's, or a benchmark's draw): the imbalance (the steps' summed slowest
    rank over their summed mean rank, cost = encoders + LLM: a run waits for its slowest rank step after step,
    so rare heavy steps count in full where a median would drop them), and medians over steps of the share of
    sequence tokens filled and of the metadata bytes a rank reads (its own samples', or every sample of its
    group's window). Each rank's (group's) stream takes every ranks-th (groups-th) sample, as the loaders'
    views do; fewer steps when the samples run out."""
    members = balance_group_size(policy, group, ranks, ranks)
    streams = ranks // members
    size = np.asarray(tokens).tolist().__getitem__  # Python ints: packing's bitsets

    def costs_of(items: list[int]) -> np.ndarray:
        return costs[np.asarray(items, dtype=np.int64)]

    packers = [
        BatchPacker(bins, capacity, lookahead, size=size)
        if members == 1 and policy == "none"
        else GroupPacker(members, 0, bins, capacity, lookahead, costs_of, size=size)
        for _ in range(streams)
    ]
    cursors = [iter(range(k, len(tokens), streams)) for k in range(streams)]
    per_step: dict[str, list[float]] = {"slowest": [], "mean": [], "fill": [], "metadata_bytes_per_rank": []}
    for _ in range(steps):
        loads, filled, read = np.zeros((streams, members)), np.zeros((streams, members)), 0
        for k, (packer, cursor) in enumerate(zip(packers, cursors)):
            while not packer.ready:
                i = next(cursor, None)
                if i is None:
                    return _run_figures(per_step)
                if tokens[i] <= capacity:
                    packer.add(i)
                    read += 1
            placed = packer.pack()
            if isinstance(packer, GroupPacker):
                loads[k], filled[k] = packer.costs.sum(axis=1), packer.filled
            else:
                loads[k, 0] = sum(costs[i].sum() for seq in placed for i in seq)
                filled[k, 0] = sum(int(tokens[i]) for seq in placed for i in seq)
        per_step["slowest"].append(float(loads.max()))
        per_step["mean"].append(float(loads.mean()))
        per_step["fill"].append(float(filled.mean()) / (bins * capacity))
        per_step["metadata_bytes_per_rank"].append(read / streams * METADATA_BYTES)
    return _run_figures(per_step)


def _run_figures(per_step: dict[str, list[float]]) -> dict[str, float]:
    """`simulate`'s figures from its steps (NaN for each when there were none)."""
    if not per_step["mean"]:
        return {"imbalance": float("nan"), "fill": float("nan"), "metadata_bytes_per_rank": float("nan")}
    total = sum(per_step["mean"])
    return {
        "imbalance": sum(per_step["slowest"]) / total if total > 0 else 1.0,
        "fill": float(np.median(per_step["fill"])),
        "metadata_bytes_per_rank": float(np.median(per_step["metadata_bytes_per_rank"])),
    }
