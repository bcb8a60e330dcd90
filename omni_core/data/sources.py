"""Sample streams from a JSONL manifest or WebDataset shards, local or on S3.

A stream serves one consumer (a rank's loader worker) of `consumers`: with at least as many shards as
consumers, each consumer reads whole shards (reshuffled every epoch for training); with fewer, every consumer
reads all shards and keeps every consumers-th record. Records come out measured (token counts from metadata)
but not decoded. Each item a stream yields carries the position just after it, so a consumer's position is
exact between any two records and a resumed stream meets, and counts, exactly the records it had not met.
The metadata profile reads the same entries as columns instead (`ShardedSource.measured`): no Sample and no
Record per entry, which is most of the cost of a record.

Bad input never stops a stream: a malformed record, a missing member, a truncated shard are each counted
under a reason (see `source_base.SKIP_REASONS`) and logged with the file and line or member they come from.

This module holds what the JSONL and WebDataset sources (`jsonl_source`, `wds_source`) share: shard plans
per epoch and consumer, chunked parsing and measuring, and the stream that hands the records out.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from omni_core.common.tokenizer import BYTE_TOKENIZER, Tokenizer
from omni_core.data.conversation import MediaRef, NoRenderer, Render, media_segment, parse_conversation
from omni_core.data.sample import (
    KIND_CODE,
    SIZE_FIELDS,
    Measures,
    Sample,
    Segment,
    SegmentFields,
    SegmentRows,
    measure,
    rendered_text_tokens,
)
from omni_core.data.source_base import CorruptSample, Record, Sizes, Source, Stream, View, in_heldout
from omni_core.data.storage import Storage
from omni_core.recipe.data_sections import DataConfig

log = logging.getLogger(__name__)

CHUNK = 1024  # records parsed before one vectorized `measure`
LOGGED_PER_SHARD = 5  # bad records logged in full per shard; the rest are counted


class Position(NamedTuple):
    """Where a sharded stream stands: before entry `number` (at byte `offset`) of the `slot`-th shard of this
    consumer's epoch plan, with `ordinal` records yielded so far."""

    epoch: int = 0
    slot: int = 0
    offset: int = 0
    number: int = 0
    ordinal: int = 0


class Entry(NamedTuple):
    """A shard entry before parsing: a JSONL line or a WebDataset sample's members."""

    number: int  # its place in the shard, from 0
    offset: int  # where it starts
    after: int  # where the next entry starts
    content: Any


class Parsed(NamedTuple):
    """A parsed entry: what `_parse` returns."""

    id: str
    modality: str
    fields: list[SegmentFields]
    payload: Any  # (Sample, where its media are), or None when not asked to build it
    text_tokens: int | None = None  # a rendered conversation's text tokens (SegmentRows.add)


class Truncated(NamedTuple):
    """A shard that ends early: what went wrong, and how many whole samples came before; the rest is lost."""

    detail: str
    met: int


@dataclass
class _Parsed:
    """Consecutive entries of one shard, parsed, and their samples measured (CHUNK samples at most)."""

    entries: list[tuple[Entry | None, int, Any]]  # (entry, its sample's index or -1, payload or skip reason);
    #                                              entry None: the shard broke off there
    modality: list[int]  # per sample, its code in KINDS
    sizes: Measures  # per sample

    @property
    def usable(self) -> int:
        return len(self.modality) - sum(map(bool, self.sizes.problem))

    def stream_items(self) -> list[tuple[Record | str, tuple[int, int]]]:
        """(record or skip reason, (offset, index) after it) per entry; records carry ref=[offset, index]."""
        sizes = self.sizes
        columns = [getattr(sizes, name).tolist() for name in SIZE_FIELDS]
        items: list[tuple[Record | str, tuple[int, int]]] = []
        for raw, i, extra in self.entries:
            after = (-1, -1) if raw is None else (raw.after, raw.number + 1)  # broke off: resume at the next shard
            if raw is None or i < 0 or sizes.problem[i]:  # a broken-off shard's entries are skips (i < 0)
                items.append((extra if i < 0 else sizes.problem[i], after))
            else:
                sample = extra[0]
                items.append(
                    (
                        Record(
                            [raw.offset, raw.number],
                            0,
                            sample.id,
                            sample.modality,
                            *(c[i] for c in columns),
                            segment_tokens=sizes.segment_tokens[i],
                            payload=extra,
                        ),
                        after,
                    )
                )
        return items

    def columns(self) -> tuple[Sizes, list[tuple[int, str]]]:
        """The usable samples' sizes, and each skipped entry as (usable samples before it, reason)."""
        sizes, problem = self.sizes, self.sizes.problem
        columns = Sizes(np.array(self.modality, dtype=np.int64), *(getattr(sizes, name) for name in SIZE_FIELDS))
        if len(self.entries) == len(problem) and not any(problem):
            return columns, []
        skips, usable = [], 0
        for _, i, extra in self.entries:
            if i >= 0 and not problem[i]:
                usable += 1
            else:
                skips.append((usable, extra if i < 0 else problem[i]))
        keep = np.array([not p for p in problem], dtype=bool)
        return Sizes(*(c[keep] for c in columns)), skips


class ShardedSource(Source):
    """Common to JSONL and WebDataset: shard plans per epoch and consumer, chunked parsing and measuring."""

    suffix: str

    def __init__(self, location: str, cfg: DataConfig) -> None:
        self.location, self.cfg = location, cfg
        self.storage = Storage(cfg.s3_endpoint_url)
        self.shards = self._shards(location)
        if not self.shards:
            raise FileNotFoundError(f"{location}: no *{self.suffix} shard found")
        self.identity = f"{location} ({len(self.shards)} shards)"
        self.held: dict[str, int] = {}  # samples per shard, where an index says (a truncated shard's lost ones)
        # conversation records' renderer (messages -> Rendered): the recipe's tokenizer and chat template
        self.render: Render | None = None
        self.tokenizer: Tokenizer = BYTE_TOKENIZER  # what text is counted in: the recipe's (dataset.open_source)

    def _shards(self, location: str) -> list[str]:
        return self.storage.shards(location, self.suffix)

    def plan(self, view: View, epoch: int) -> tuple[list[int], int]:
        """(shard indices this consumer reads in `epoch`, record stride): whole shards when there are enough
        to go round, else every shard with every consumers-th record."""
        count = len(self.shards)
        order = np.random.default_rng([view.seed, epoch]).permutation(count) if view.shuffle else np.arange(count)
        if count >= view.consumers:
            return order[view.consumer :: view.consumers].tolist(), 1
        return order.tolist(), view.consumers

    def stream(self, view: View, position: list[int] | None, on_skip: Callable[[str], None]) -> Stream:
        chunks = self._chunks(view, Position(*(position or ())), build=True)
        return _ShardStream(((epoch, slot, parsed.stream_items()) for epoch, slot, parsed in chunks), on_skip, position)

    def measured(self, view: View) -> Iterator[tuple[Sizes, list[tuple[int, str]]]]:
        """The view's stream from its start, as columns CHUNK samples at a time, without a Sample or a Record
        per entry (the metadata profile's path): (sizes of the usable records, skipped entries as (usable
        records before it, reason)). It meets and skips exactly what `stream` does."""
        for _, _, parsed in self._chunks(view, Position(), build=False):
            yield parsed.columns()

    def check_usable(self) -> None:
        """Raise ValueError unless one pass meets a usable sample: an empty or all-bad dataset fails the profile
        and starves training. Reads no further than the first chunk that holds one."""
        skipped: Counter[str] = Counter()
        for sizes, skips in self.measured(View(0, 1, "all", seed=0, one_pass=True, shuffle=False)):
            if len(sizes.modality):
                return
            skipped.update(reason for _, reason in skips)
        if not skipped:
            raise ValueError(f"{self.identity}: no sample at all (empty)")
        reasons = ", ".join(f"{n} {reason}" for reason, n in skipped.items())
        raise ValueError(f"{self.identity}: no usable sample ({reasons} skipped)")

    def refetch(self, view: View, ref: list[int]) -> Record:
        for _, _, parsed in self._chunks(view, Position(*ref), build=True):
            for item, _ in parsed.stream_items():
                if type(item) is Record:
                    item.ref, item.ordinal = list(ref), ref[-1]
                    return item
        raise ValueError(f"{self.location}: no record at the saved position {ref}: the data changed")

    def sample(self, record: Record) -> Sample:
        return record.payload[0]

    @abstractmethod
    def _entries(self, shard: str, offset: int, index: int) -> Iterator[Entry | Truncated]:
        """A shard's entries from byte `offset`, which is entry `index`."""

    @abstractmethod
    def _parse(self, shard: str, raw: Entry, build: bool) -> Parsed:
        """The entry parsed: the payload (sample, where its media are) only if `build` (else None, or whatever
        the source had to build anyway); raises CorruptSample (reason) or ValueError (a bad record)."""

    def _conversation(
        self,
        obj: Any,
        where: Any,
        media: Callable[[str, MediaRef], tuple[str, bytes | None]],
        unlisted: Mapping[str, list[str]] | None = None,
    ) -> Parsed:
        """A conversation record as a rendered sample. `media(id, ref)` is (the segment's path, the file's bytes
        when the record gives no sizes, else None): the sizes come from the record, or from the file's header.
        `unlisted`: per kind, paths its markers take when the record lists none of that kind."""
        if self.render is None:
            raise NoRenderer(
                f"{self.location}: conversation records need a tokenizer with a chat template "
                "(model.pretrained.llm's tokenizer_config.json chat_template)"
            )
        conv = parse_conversation(obj, unlisted)
        segments = [media_segment(conv.id, ref, *media(conv.id, ref)) for ref in conv.media]
        rendered = self.render(conv.messages)
        sample = Sample(conv.id, conv.modality, [*segments, Segment("text")], rendered)
        fields = [seg.fields() for seg in sample.segments]
        text = rendered_text_tokens(rendered, len(segments), self.tokenizer)
        return Parsed(conv.id, conv.modality, fields, (sample, where), text)

    def _chunks(self, view: View, at: Position, build: bool) -> Iterator[tuple[int, int, _Parsed]]:
        """(epoch, slot, parsed entries) over epochs, from `at` on."""
        epoch, slot, offset, index, _ = at
        while True:
            shards, stride = self.plan(view, epoch)
            whole_epoch, records = slot == offset == 0, 0
            for k in range(slot, len(shards)):
                keep = _kept_entries(stride, k, view.consumer)
                for parsed in self._shard_chunks(view, self.shards[shards[k]], offset, index, keep, build):
                    records += parsed.usable
                    yield epoch, k, parsed
                offset = index = 0
            if view.one_pass:
                return
            if whole_epoch and not records:
                raise ValueError(
                    f"{self.location}: a whole epoch without one usable {view.split} sample "
                    f"for consumer {view.consumer} of {view.consumers}"
                )
            epoch, slot = epoch + 1, 0

    def _shard_chunks(
        self, view: View, shard: str, offset: int, index: int, keep: Callable[[int], bool], build: bool
    ) -> Iterator[_Parsed]:
        """A shard's entries from byte `offset` (entry `index`) in order, parsed and measured CHUNK samples at
        a time; samples go into columns as they are parsed."""
        entries: list[tuple[Entry | None, int, Any]] = []
        modalities: list[int] = []
        rows = SegmentRows(self.tokenizer)
        logged = 0

        def flush() -> _Parsed:
            nonlocal entries, modalities, rows
            parsed = _Parsed(
                entries, modalities, measure(rows.segments(), rows.samples, self.cfg, self.tokenizer, self.towers)
            )
            entries, modalities, rows = [], [], SegmentRows(self.tokenizer)
            return parsed

        for raw in self._entries(shard, offset, index):
            if isinstance(raw, Truncated):
                held = self.held.get(shard)
                lost = sum(map(keep, range(raw.met, held))) if held is not None else 0
                log.warning(
                    "%s: truncated_shard: %s; %s",
                    shard,
                    raw.detail,
                    f"{lost} samples lost"
                    if held is not None
                    else "no shardindex.json entry: lost samples not counted",
                )
                entries.append((None, -1, "truncated_shard"))
                entries += [(None, -1, "lost_sample")] * lost
                yield flush()
                return
            if not keep(raw.number):
                continue
            try:
                sample_id, modality, fields, payload, text_tokens = self._parse(shard, raw, build)
            except NoRenderer:
                raise
            except (CorruptSample, ValueError) as err:
                reason = err.reason if isinstance(err, CorruptSample) else "bad_record"
                if logged < LOGGED_PER_SHARD:
                    log.warning("%s: skipped entry %d: %s: %s", shard, raw.number + 1, reason, err)
                    logged += 1
                entries.append((raw, -1, reason))
                continue
            if view.split != "all" and in_heldout(sample_id, self.cfg.heldout_fraction) != (view.split == "heldout"):
                continue
            entries.append((raw, rows.samples, payload))
            modalities.append(KIND_CODE[modality])
            rows.add(fields, text_tokens)
            if rows.samples == CHUNK:
                yield flush()
        yield flush()
        if logged == LOGGED_PER_SHARD:
            log.warning("%s: further bad entries were counted, not logged", shard)


def _kept_entries(stride: int, slot: int, consumer: int) -> Callable[[int], bool]:
    """Which entries of its `slot`-th shard a consumer reads: all of them when it reads whole shards (stride
    1), else every stride-th, starting where its turn falls in that shard."""
    if stride == 1:
        return lambda i: True
    return lambda i: (i + slot) % stride == consumer


class _ShardStream(Stream):
    """Hands out the items of `_Parsed.stream_items` one by one: counts skips, numbers records, and knows
    the position after the last item handed out."""

    def __init__(
        self,
        chunks: Iterator[tuple[int, int, list[tuple[Record | str, tuple[int, int]]]]],
        on_skip: Callable[[str], None],
        position: list[int] | None,
    ) -> None:
        self._chunks, self._on_skip = chunks, on_skip
        self._epoch, self._slot, self._offset, self._index, self._ordinal = Position(*(position or ()))
        self._items: list[tuple[Record | str, tuple[int, int]]] = []
        self._next = 0

    def next(self, step: int) -> Record | None:
        while True:
            while self._next == len(self._items):
                chunk = next(self._chunks, None)
                if chunk is None:
                    return None
                self._epoch, self._slot, self._items = chunk
                self._next = 0
            item, (self._offset, self._index) = self._items[self._next]
            self._next += 1
            if isinstance(item, Record):
                item.ref = [self._epoch, self._slot, *item.ref, self._ordinal]
                item.ordinal = self._ordinal
                self._ordinal += 1
                return item
            self._on_skip(item)

    def position(self) -> list[int]:
        if self._offset < 0:  # the shard broke off: go on with the next one
            return [self._epoch, self._slot + 1, 0, 0, self._ordinal]
        return [self._epoch, self._slot, self._offset, self._index, self._ordinal]
