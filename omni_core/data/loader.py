"""The per-rank loader: streams records, packs them from metadata, decodes only what a batch holds.

A rank's loader runs max(1, data.num_workers) consumers, each with its own part of the source (consumer
rank * workers + w of world_size * workers): in the training process when num_workers is 0, else in worker
processes whose batches are taken in turn. A consumer's state (its stream position, the samples waiting
in its packer, its batch count and skip counts) is JSON-able and restores it exactly; the loader's state is
its consumers' states plus the number of batches drawn, so a resumed loader yields exactly the batches an
uninterrupted one would have.

Training step and mix schedule: the n-th batch a rank draws is step n (a step is one micro-batch per rank,
so one optimizer step when train.grad_accum is 1). Consumer w of a rank forms batches w, w + W, w + 2W, ...,
and asks a scheduled source for samples at the step of the batch it is filling.

Balancing (`data.balance`, see `balance`): under `grouped` and `global` the consumers of a group's members read
one stream, the group's, and place each window over the members' next `step_batches` batches at once (an
optimizer step's micro-batches, so that each rank's step is balanced as a whole); a consumer keeps the batches
placed on its own rank queued, and its state holds them.
"""

from __future__ import annotations

import gc
import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from omni_core.common.batch import PackedBatch
from omni_core.data.balance import Balance, GroupPacker, make_packer
from omni_core.data.dataset import CorruptSample, DecodedSample, ManifestDataset, Split
from omni_core.data.packing import collate
from omni_core.data.prefetch import DevicePrefetcher
from omni_core.data.source_base import Record, View
from omni_core.recipe.data_sections import DataConfig

log = logging.getLogger(__name__)
MAX_REJECTED = 10_000  # consecutive samples over seq_len after which a stream is declared unusable


class ConsumerStream:
    """One consumer's batches: records from its stream, packed (or placed over its group), decoded."""

    def __init__(
        self,
        dataset: ManifestDataset,
        cfg: DataConfig,
        view: View,
        step_of: Callable[[int], int],
        state: dict[str, Any] | None = None,
        *,
        balance: Balance | None = None,
    ) -> None:
        self.dataset, self.cfg, self.view, self.step_of = dataset, cfg, view, step_of
        self.balance = balance or Balance()
        b = self.balance
        self.packer = make_packer(
            b.policy, b.members, b.member, cfg.micro_batch * b.placed_batches, cfg.seq_len, cfg.pack_lookahead, b.cost
        )
        self.queue: list[list[list[Record]]] = []  # batches placed on this rank, not yet drawn
        self.batch, self.stats, self.rejected = 0, {}, 0
        position = None
        if state is not None:
            self.batch, self.stats, position = state["batch"], dict(state["stats"]), state["position"]
            for ref, waited in state["pending"]:
                self.packer.add(dataset.source.refetch(view, ref), waited)
            self.queue = [
                [[dataset.source.refetch(view, ref) for ref in seq] for seq in batch]
                for batch in state.get("queued", [])
            ]
        self.stream = dataset.source.stream(view, position, self._count)

    def _count(self, reason: str) -> None:
        self.stats[reason] = self.stats.get(reason, 0) + 1

    def _fill(self, step: int) -> None:
        while not self.packer.ready:
            record = self.stream.next(step)
            if record is None:
                return
            if record.tokens <= self.cfg.seq_len:
                self.rejected = 0
                self.packer.add(record)
                continue
            self._count("too_long")
            self.rejected += 1
            if self.rejected >= MAX_REJECTED:
                raise ValueError(
                    f"{self.dataset.location}: {MAX_REJECTED} samples in a row are longer than "
                    f"seq_len={self.cfg.seq_len}"
                )

    def next_sequences(self) -> list[list[Record]] | None:
        """The next batch's records per sequence (None when a one-pass stream is done)."""
        if not self.queue:
            self._fill(self.step_of(self.batch))
            if not self.packer.pool:
                return None
            sequences = self.packer.pack()
            mb = self.cfg.micro_batch
            self.queue = [sequences[i : i + mb] for i in range(0, len(sequences), mb)]
        self.batch += 1
        return self.queue.pop(0)

    def next_batch(self) -> PackedBatch | None:
        sequences = self.next_sequences()
        if sequences is None:
            return None
        docs = [[self._decode(record) for record in seq] for seq in sequences]
        batch = collate(docs, self.cfg, self.dataset.tokenizer)
        if self.balance.cost is not None:
            costs = self.balance.cost.of_records([record for seq in sequences for record in seq])
            batch.predicted_flops = (float(costs[:, 0].sum()), float(costs[:, 1].sum()))
        if isinstance(self.packer, GroupPacker):
            batch.balance_s = self.packer.balance_s / self.balance.step_batches
        return batch

    def _decode(self, record: Record) -> DecodedSample:
        try:
            return self.dataset.decode(record)
        except CorruptSample as err:
            self._count(err.reason)
            log.warning("skipping %s", err)
            return DecodedSample.padding(record.tokens, self.dataset.tokenizer.pad_id)

    def state(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "position": self.stream.position(),
            "stats": dict(self.stats),
            "pending": [[p.item.ref, p.waited] for p in self.packer.pool],
            "queued": [[[record.ref for record in seq] for seq in batch] for batch in self.queue],
        }


class _Workers(torch.utils.data.IterableDataset):
    """Worker w serves consumer slot (w + rotation) % W, so that after a resume the DataLoader's first
    worker is the one whose batch is due."""

    def __init__(self, loader: PackedLoader, rotation: int) -> None:
        self.loader, self.rotation = loader, rotation

    def __iter__(self) -> Iterator[tuple[int, PackedBatch, dict[str, Any]]]:
        worker = torch.utils.data.get_worker_info()
        assert worker is not None  # iterated only in the DataLoader's worker processes (num_workers = slots)
        slot = (worker.id + self.rotation) % self.loader.slots
        stream = self.loader.consumer(slot)
        while (batch := stream.next_batch()) is not None:
            yield slot, batch, stream.state()


class PackedLoader:
    """Iterable of `PackedBatch`: endless over reshuffled epochs for "train", one pass for "heldout" (each
    iter() a fresh pass). Passes are not equally long on every rank: evaluation runs on one.

    `balance`: how training batches are balanced over data ranks (`balance.Balance`: the policy, this rank's
    group and the cost model); held-out passes are never rebalanced. `stats` counts what this rank skipped, by
    reason (sources.SKIP_REASONS). `device`: batches come out on it (`prefetch.DevicePrefetcher`: on CUDA
    pinned, and copied one batch ahead), the state still that of the batches handed out; None: host batches."""

    def __init__(
        self,
        dataset: ManifestDataset,
        data_cfg: DataConfig,
        split: Split = "train",
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        balance: Balance | None = None,
        device: torch.device | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.dataset, self.cfg, self.split = dataset, data_cfg, split
        self.rank, self.world_size, self.seed, self.device = rank, world_size, seed, device
        self.balance = balance if balance is not None and split == "train" else Balance()
        readers = self.balance.readers
        if world_size % readers or (readers > 1 and self.balance.member != rank % readers):
            raise ValueError(
                f"rank {rank} of {world_size} is not member {self.balance.member} of a balancing group of {readers}"
            )
        self.slots = max(1, data_cfg.num_workers)
        self._states: list[dict[str, Any] | None] = [None] * self.slots
        self._batches = 0

    def view(self, slot: int) -> View:
        """The consumer's share of the source: its rank's, or its group's (every member reads the same)."""
        readers = self.balance.readers
        return View(
            self.rank // readers * self.slots + slot,
            self.world_size // readers * self.slots,
            self.split,
            self.seed,
            one_pass=self.split == "heldout",
            shuffle=self.split == "train",
        )

    def consumer(self, slot: int) -> ConsumerStream:
        slots = self.slots
        per_step = self.balance.step_batches  # a scheduled source follows the optimizer step, whatever the plan
        return ConsumerStream(
            self.dataset,
            self.cfg,
            self.view(slot),
            lambda b: (b * slots + slot) // per_step,
            self._states[slot],
            balance=self.balance,
        )

    def __iter__(self) -> Iterator[PackedBatch]:
        if self.cfg.num_workers:
            # forked workers must not inherit a process group left as garbage: one that collected it would
            # join its threads, which the fork did not copy, and hang (`runtime.ranks.run_ranks` does the same)
            gc.collect()
            batches: Iterator[tuple[int, PackedBatch, dict[str, Any]]] = iter(
                torch.utils.data.DataLoader(
                    _Workers(self, self._batches % self.slots),
                    batch_size=None,
                    num_workers=self.slots,
                    pin_memory=self.device is not None and self.device.type == "cuda",  # pinned in a thread
                )
            )
        else:
            batches = self._in_process()
        drawn: deque[tuple[int, dict[str, Any]]] = deque()  # slot and state of each batch drawn, not handed out

        def host_batches() -> Iterator[PackedBatch]:
            for slot, batch, state in batches:
                drawn.append((slot, state))
                yield batch

        for batch in DevicePrefetcher(host_batches(), self.device) if self.device else host_batches():
            slot, state = drawn.popleft()
            self._states[slot] = state
            self._batches += 1
            yield batch
        self._states, self._batches = [None] * self.slots, 0  # a finished pass: the next iter() starts afresh

    def _in_process(self) -> Iterator[tuple[int, PackedBatch, dict[str, Any]]]:
        stream = self.consumer(0)
        while (batch := stream.next_batch()) is not None:
            yield 0, batch, stream.state()

    @property
    def stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for state in filter(None, self._states):
            for reason, count in state["stats"].items():
                total[reason] = total.get(reason, 0) + count
        return total

    def state_dict(self) -> dict[str, Any]:
        """Position of the next batch: what each consumer has drawn, decoded or left pending."""
        return {
            "split": self.split,
            "seed": self.seed,
            "world_size": self.world_size,
            "num_workers": self.cfg.num_workers,
            "source": self.dataset.source.identity,
            "batches": self._batches,
            "consumers": list(self._states),
            "balance": self.balance.identity,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("split", "seed", "world_size", "num_workers", "source", "balance"):
            if state.get(key, "none") != mine[key]:
                raise ValueError(f"loader state is for {key}={state.get(key, 'none')!r}, this loader has {mine[key]!r}")
        self._batches, self._states = state["batches"], list(state["consumers"])
