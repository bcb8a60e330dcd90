"""Packing: which samples share a sequence (decided from token counts alone), and laying decoded documents
out as a `PackedBatch` with their boundaries in cu_seqlens."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from operator import attrgetter
from typing import Generic, NamedTuple, TypeVar

import torch

from omni_core.common.batch import MODALITY_IDS, PackedBatch
from omni_core.common.tokenizer import BYTE_TOKENIZER, Tokenizer, never_predicted
from omni_core.data.dataset import DecodedSample
from omni_core.recipe.data_sections import DataConfig

IGNORE = -100
OVERDUE = 2  # batches a sample may be passed over before it is placed ahead of everything else


S = TypeVar("S")


class Pending(NamedTuple, Generic[S]):
    item: S
    waited: int  # batches it was left out of


class BatchPacker(Generic[S]):
    """Fills batches of `bins` sequences of `capacity` tokens from a stream of samples.

    Samples wait in a pool until it holds `lookahead` batches' worth of tokens. Each sequence of a batch is
    then filled as fully as the pool allows (an exact subset sum over the pool, so at least as dense as
    first-fit decreasing), preferring the samples that came first; what does not fit waits for the next batch.
    Choosing only within the pool keeps the stream's order, hence its modality mix, at the scale of batches;
    a sample passed over OVERDUE times is placed before any choice is made, so none starves.

    An item's size is `size(item)` (its `tokens` by default; the profile packs bare token counts). The pool is
    kept as parallel lists of items, sizes and waits: packing touches only integers."""

    def __init__(
        self, bins: int, capacity: int, lookahead: float, size: Callable[[S], int] = attrgetter("tokens")
    ) -> None:
        self.bins, self.capacity, self.size = bins, capacity, size
        self.target = lookahead * bins * capacity
        self.items: list[S] = []
        self.sizes: list[int] = []
        self.waits: list[int] = []
        self.pool_tokens = 0

    @property
    def pool(self) -> list[Pending[S]]:
        """The samples waiting, in pool order."""
        return [Pending(item, waited) for item, waited in zip(self.items, self.waits)]

    @property
    def ready(self) -> bool:
        """Enough pending tokens to pack a batch as densely as the lookahead allows."""
        return self.pool_tokens >= self.target

    def add(self, item: S, waited: int = 0) -> None:
        tokens = self.size(item)
        if tokens > self.capacity:
            raise self._oversized(tokens)
        self.items.append(item)
        self.sizes.append(tokens)
        self.waits.append(waited)
        self.pool_tokens += tokens

    def _oversized(self, tokens: int) -> ValueError:
        return ValueError(f"a sample of {tokens} tokens cannot fit sequences of {self.capacity}")

    def fill(self, items: Sequence[S]) -> Iterator[list[list[S]]]:
        """Adds the items in order, packing a batch each time the pool gets ready, as `add` one by one would (but
        an oversized item raises before any is added). Items go in by slices, up to each point where the pool
        gets ready: no call per item."""
        sizes = list(map(self.size, items))
        if sizes and max(sizes) > self.capacity:
            raise self._oversized(max(sizes))
        reached = list(accumulate(sizes, initial=0))  # reached[j]: tokens of the first j items
        start = 0
        while start < len(sizes):
            # the pool is ready once it holds items up to the first end with reached[end] >= this
            end = min(bisect_left(reached, self.target - self.pool_tokens + reached[start], start + 1), len(sizes))
            self.items += items[start:end]
            self.sizes += sizes[start:end]
            self.waits += [0] * (end - start)
            self.pool_tokens += reached[end] - reached[start]
            start = end
            while self.ready:
                yield self.pack()

    def pack(self) -> list[list[S]]:
        """One batch: `bins` sequences (some possibly empty) of pool samples, removed from the pool."""
        sizes, waits, capacity = self.sizes, self.waits, self.capacity
        loads = [0] * self.bins
        sequences: list[list[int]] = [[] for _ in range(self.bins)]  # pool indices per sequence
        if max(waits, default=0) >= OVERDUE:
            overdue = sorted((i for i, w in enumerate(waits) if w >= OVERDUE), key=lambda i: -sizes[i])
            left = [i for i, w in enumerate(waits) if w < OVERDUE]  # in stream order: older ones are preferred
            for i in overdue:  # best fit decreasing: into the fullest sequence with room
                fits = [b for b in range(self.bins) if loads[b] + sizes[i] <= capacity]
                if not fits:
                    left.insert(0, i)
                    continue
                b = max(fits, key=loads.__getitem__)
                loads[b] += sizes[i]
                sequences[b].append(i)
        else:
            left = list(range(len(sizes)))
        for b in range(self.bins):
            chosen = fullest_subset([sizes[i] for i in left], capacity - loads[b])
            for j in chosen:
                sequences[b].append(left[j])
                loads[b] += sizes[left[j]]
            left = [i for j, i in enumerate(left) if j not in chosen]
        items = self.items
        self.items, self.sizes = [items[i] for i in left], [sizes[i] for i in left]
        self.waits = [waits[i] + 1 for i in left]
        self.pool_tokens -= sum(loads)
        return [[items[i] for i in seq] for seq in sequences]


def fullest_subset(sizes: list[int], room: int) -> set[int]:
    """Indices of sizes with the largest sum <= room; among equal sums, earlier indices are preferred.

    Subset sum with Python integers as bitsets: bit s of reach[i] says that some subset of the first i sizes
    sums to s. Walking back from the last size, a size is left out whenever its prefix reaches the sum alone
    (so sizes after the prefix that first fills the room exactly are never chosen, and are not looked at)."""
    mask, full = (1 << (room + 1)) - 1, 1 << room
    reach = [1]
    for size in sizes:
        reach.append((reach[-1] | (reach[-1] << size)) & mask)
        if reach[-1] & full:
            break
    total, chosen = reach[-1].bit_length() - 1, set()
    for i in range(len(reach) - 2, -1, -1):
        if not (reach[i] >> total) & 1:
            chosen.add(i)
            total -= sizes[i]
    return chosen


def document_labels(ids: torch.Tensor, tokenizer: Tokenizer, trainable: list[bool] | None = None) -> torch.Tensor:
    """Next-token targets inside one document: every next token but placeholders, BOS and padding
    (`tokenizer.never_predicted`) and, where the document marks its targets (`trainable`: a conversation's
    replies, unless data.train_on_prompt), only those; the last token gets IGNORE (the first caption token after an
    image IS a target)."""
    labels = torch.full_like(ids, IGNORE)
    nxt = ids[1:]
    keep = ~torch.isin(nxt, torch.tensor(sorted(never_predicted(tokenizer)), dtype=ids.dtype))
    if trainable is not None:
        keep &= torch.tensor(trainable[1:], dtype=torch.bool)
    labels[:-1] = torch.where(keep, nxt, IGNORE)
    return labels


PAD_DOC = 128  # tokens per padding document at most


def _split_padding(tokens: int, pad_id: int) -> list[DecodedSample]:
    return [DecodedSample.padding(min(PAD_DOC, tokens - start), pad_id) for start in range(0, tokens, PAD_DOC)]


def collate(
    sequences: list[list[DecodedSample]], cfg: DataConfig, tokenizer: Tokenizer = BYTE_TOKENIZER
) -> PackedBatch:
    """Lays sequences end to end, each filled to exactly cfg.seq_len by trailing padding documents of at most
    PAD_DOC tokens: attention runs within each document, so padding costs attention linear in its length
    (PAD_DOC x padding), not its square, and no real token ever sees it (nor is any padding a target). The
    documents' ids are `tokenizer`'s."""
    docs: list[DecodedSample] = []
    for seq in sequences:
        used = sum(len(d.input_ids) for d in seq)
        if used > cfg.seq_len:
            raise ValueError(f"sequence holds {used} tokens, more than seq_len={cfg.seq_len}")
        filled = [*seq, DecodedSample.padding(cfg.seq_len - used)] if used < cfg.seq_len else seq
        for doc in filled:  # a sample that failed to decode is padding too
            docs.extend(_split_padding(len(doc.input_ids), tokenizer.pad_id) if doc.is_padding else [doc])
    ids = [torch.tensor(d.input_ids, dtype=torch.long) for d in docs]
    lengths = torch.tensor([len(d.input_ids) for d in docs], dtype=torch.int32)
    patch_dim = 3 * cfg.patch_size**2
    return PackedBatch(
        input_ids=torch.cat(ids),
        labels=torch.cat(
            [
                torch.full_like(x, IGNORE) if d.is_padding else document_labels(x, tokenizer, d.trainable)
                for x, d in zip(ids, docs)
            ]
        ),
        position_ids=torch.cat([torch.arange(len(x)) for x in ids]),
        cu_seqlens=torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0)),
        loss_modality=torch.cat([torch.full((len(x),), MODALITY_IDS[d.modality]) for x, d in zip(ids, docs)]),
        image_patches=torch.cat([p for d in docs for p in d.image_patches] + [torch.empty(0, patch_dim)]),
        image_grids=torch.tensor([g for d in docs for g in d.image_grids], dtype=torch.long).reshape(-1, 2),
        audio_mels=torch.cat([m for d in docs for m in d.audio_mels] + [torch.empty(0, cfg.n_mels)]),
        audio_frames=torch.tensor([len(m) for d in docs for m in d.audio_mels], dtype=torch.long),
        video_patches=torch.cat([p for d in docs for p in d.video_patches] + [torch.empty(0, patch_dim)]),
        video_grids=torch.tensor([g for d in docs for g in d.video_grids], dtype=torch.long).reshape(-1, 3),
        num_samples=sum(not d.is_padding for d in docs),
        tokenizer=tokenizer,
    )
