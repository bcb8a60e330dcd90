"""The per-rank loader: seeded shuffling, sharding and packing from metadata, decoding only what a batch needs.

Every rank computes the packing of every shard (metadata only, cheap), so all ranks agree on the number of
batches per epoch without communicating and DP ranks never wait on a rank that ran dry. The position is a
pure function of (epoch, batch), identical on all ranks, which is what makes resuming exact.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from omni_core.data.batch import PackedBatch
from omni_core.data.dataset import CorruptSample, DecodedSample, ManifestDataset, Split
from omni_core.data.packing import collate, pack_sequences
from omni_core.recipe.schema import DataConfig

log = logging.getLogger(__name__)


def epoch_order(indices: list[int], seed: int, epoch: int) -> list[int]:
    """An epoch's seeded shuffle; the profiler packs in this order too, so its efficiency is the loader's."""
    return [indices[j] for j in np.random.default_rng([seed, epoch]).permutation(len(indices))]


class PackedLoader:
    """Iterable of `PackedBatch`: infinite over reshuffled epochs for "train", one pass for "heldout".

    `stats` counts what was skipped, by reason: "too_long" (samples of the split over seq_len, counted once,
    the same on every rank) and the `CorruptSample` reasons (each time this rank meets one)."""

    def __init__(
        self,
        dataset: ManifestDataset,
        data_cfg: DataConfig,
        split: Split = "train",
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.dataset, self.cfg, self.split = dataset, data_cfg, split
        self.rank, self.world_size, self.seed = rank, world_size, seed
        indices = dataset.splits[split]
        self._eligible = [i for i in indices if dataset.token_count(i) <= data_cfg.seq_len]
        self.stats: dict[str, int] = {}
        if len(indices) > len(self._eligible):
            self.stats["too_long"] = len(indices) - len(self._eligible)
        if split == "train" and not self._eligible:
            raise ValueError(f"no {split} sample of {dataset.manifest_path} fits seq_len={data_cfg.seq_len}")
        self._epoch = 0
        self._batch = 0  # next batch of self._epoch to yield
        self._cached_plan: tuple[int, list[list[list[int]]]] | None = None

    def plan(self, epoch: int) -> list[list[list[int]]]:
        """This rank's batches of an epoch: per batch, micro_batch sequences of sample indices ([] = padding)."""
        if self._cached_plan and self._cached_plan[0] == epoch:
            return self._cached_plan[1]
        order = epoch_order(self._eligible, self.seed, epoch)
        shards = [
            pack_sequences(((i, self.dataset.token_count(i)) for i in order[r :: self.world_size]), self.cfg.seq_len)
            for r in range(self.world_size)
        ]
        micro = self.cfg.micro_batch
        num_batches = max(math.ceil(len(s) / micro) for s in shards)
        mine = shards[self.rank] + [[]] * (num_batches * micro - len(shards[self.rank]))
        plan = [mine[b * micro : (b + 1) * micro] for b in range(num_batches)]
        self._cached_plan = (epoch, plan)
        return plan

    def __iter__(self) -> Iterator[PackedBatch]:
        while True:
            plan = self.plan(self._epoch)
            while self._batch < len(plan):
                sequences = plan[self._batch]
                self._batch += 1  # before yielding: a state taken after this batch points past it
                yield collate([[self._decode(i) for i in seq] for seq in sequences], self.cfg)
            if self.split == "heldout":
                self._batch = 0  # the next iter() is a fresh pass
                return
            self._epoch, self._batch = self._epoch + 1, 0

    def _decode(self, index: int) -> DecodedSample:
        try:
            return self.dataset.decode(index)
        except CorruptSample as err:
            self.stats[err.reason] = self.stats.get(err.reason, 0) + 1
            log.warning("skipping %s", err)
            return DecodedSample.padding(self.dataset.token_count(index))

    def state_dict(self) -> dict[str, Any]:
        """Position of the next batch. It is the same on every rank, so any rank's state restores any rank."""
        return {
            "split": self.split,
            "seed": self.seed,
            "world_size": self.world_size,
            "split_size": len(self.dataset.splits[self.split]),
            "epoch": self._epoch,
            "batch": self._batch,
            "stats": dict(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("split", "seed", "world_size", "split_size"):
            if state[key] != mine[key]:
                raise ValueError(f"loader state is for {key}={state[key]!r}, this loader has {mine[key]!r}")
        self._epoch, self._batch, self.stats = state["epoch"], state["batch"], dict(state["stats"])
