"""Sample streams from a JSONL manifest or WebDataset shards, local or on S3.

A stream serves one consumer (a rank's loader worker) of `consumers`: with at least as many shards as
consumers, each consumer reads whole shards (reshuffled every epoch for training); with fewer, every consumer
reads all shards and keeps every consumers-th record. Records come out measured (token counts from metadata)
but not decoded. Each item a stream yields carries the position just after it, so a consumer's position is
exact between any two records and a resumed stream meets, and counts, exactly the records it had not met.
The metadata profile reads the same entries as columns instead (`ShardedSource.measured`): no Sample and no
Record per entry, which is most of the cost of a record.

Bad input never stops a stream: a malformed record, a missing member, a truncated shard are each counted
under a reason (see `SKIP_REASONS`) and logged with the file and line or member they come from.
"""

from __future__ import annotations

import hashlib
import logging
import tarfile
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal, NamedTuple

import numpy as np
import orjson
from PIL import Image

from omni_core.data.audio import EmptyAudio, audio_header, read_audio
from omni_core.data.image import OversizedImage, image_header, open_image, open_video_frames, video_header
from omni_core.data.sample import (
    KIND_CODE,
    SIZE_FIELDS,
    Measures,
    Sample,
    Segment,
    SegmentFields,
    SegmentRows,
    measure,
    modality_of,
    record_fields,
)
from omni_core.data.storage import Storage, join, parent
from omni_core.recipe.data_sections import DataConfig

log = logging.getLogger(__name__)

Split = Literal["train", "heldout", "all"]
SKIP_REASONS = {
    "bad_record": "metadata that does not parse or misses a field (logged with its file and line / key)",
    "missing_file": "a media file or WebDataset member the metadata names is absent",
    "unreadable_file": "bytes that do not decode as what they claim to be",
    "size_mismatch": "a decoded file disagrees with its metadata (which packing trusted)",
    "empty_audio": "an audio clip without samples",
    "oversized_image": "an image over data.max_image_pixels",
    "truncated_shard": "a tar that ends mid-member: the rest of the shard is lost",
    "lost_sample": "a sample of a truncated shard after where it broke off, counted where the dataset's "
    "shardindex.json (webdataset's wids format) says how many the shard holds",
    "too_long": "a sample longer than data.seq_len",
    "unsafe_path": "a media path that is absolute or climbs out of the manifest's folder (never read)",
}
CHUNK = 1024  # records parsed before one vectorized `measure`
LOGGED_PER_SHARD = 5  # bad records logged in full per shard; the rest are counted


class CorruptSample(Exception):
    """A sample whose bytes are missing, unreadable or disagree with its metadata; `reason` is what loaders
    and the profiler count (one of SKIP_REASONS)."""

    def __init__(self, sample_id: str, where: str, reason: str, detail: str = "") -> None:
        super().__init__(f"sample {sample_id!r}: {where}: {reason}{': ' + detail if detail else ''}")
        self.sample_id, self.where, self.reason = sample_id, where, reason


def in_heldout(sample_id: str, fraction: float) -> bool:
    """Split by a hash of the id, so a sample stays on its side when the data is reordered, resharded or grows."""
    digest = hashlib.sha256(sample_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


@dataclass(frozen=True)
class View:
    """The part of a source one consumer reads, and how."""

    consumer: int
    consumers: int
    split: Split
    seed: int
    one_pass: bool  # False: epochs without end (training)
    shuffle: bool  # reshuffle shard order every epoch


@dataclass(slots=True)
class Record:
    """One sample as a stream delivers it: measured, not decoded. `ref` finds it again after a resume."""

    ref: list[int]
    ordinal: int  # count of records this consumer's stream yielded before it
    id: str
    modality: str
    tokens: int  # LLM tokens; then the rest of sample.SIZE_FIELDS, as `Measures` defines them
    vision_tokens: int
    vision_sq: int
    audio_tokens: int
    audio_sq: int
    audio_frames: int
    image_items: int
    audio_items: int
    video_items: int
    image_llm: int
    video_llm: int
    video_frames: int
    video_patches: int
    segment_tokens: list[int]
    payload: Any  # the source's own: (Sample, where its media are) / the generator's choices


class Sizes(NamedTuple):
    """Records' measured sizes as columns (one entry per record, as in `Record`): what the profile reads."""

    modality: np.ndarray  # codes into KINDS; then sample.SIZE_FIELDS
    tokens: np.ndarray
    vision_tokens: np.ndarray
    vision_sq: np.ndarray
    audio_tokens: np.ndarray
    audio_sq: np.ndarray
    audio_frames: np.ndarray
    image_items: np.ndarray
    audio_items: np.ndarray
    video_items: np.ndarray
    image_llm: np.ndarray
    video_llm: np.ndarray
    video_frames: np.ndarray
    video_patches: np.ndarray


class Stream(ABC):
    """One consumer's records in order; `position()` is where the next one starts (JSON-able)."""

    @abstractmethod
    def next(self, step: int) -> Record | None:
        """The next record (None at the end of a one-pass stream); `step` is the training step it is drawn
        for, which only a scheduled (dynamic) source uses."""

    @abstractmethod
    def position(self) -> list[int]: ...


class Source(ABC):
    """Where samples come from. `identity` is what a saved loader position must match."""

    identity: str

    @abstractmethod
    def stream(self, view: View, position: list[int] | None, on_skip: Callable[[str], None]) -> Stream: ...

    @abstractmethod
    def refetch(self, view: View, ref: list[int]) -> Record:
        """The record a previous stream yielded under `ref` (resumed loaders re-read their pending samples)."""

    @abstractmethod
    def sample(self, record: Record) -> Sample:
        """The record's full sample, text included."""

    @abstractmethod
    def media(self, record: Record, seg: Segment) -> Any:
        """A media segment decoded: a PIL image, (waveform, rate), or (sampled frames, clip frame count);
        raises CorruptSample."""

    def where(self, record: Record, seg: Segment) -> str:
        """Where a segment's bytes live, for messages."""
        return record.id


class Position(NamedTuple):
    """Where a sharded stream stands: before record `index` (at byte `offset`) of the `slot`-th shard of this
    consumer's epoch plan, with `ordinal` records yielded so far."""

    epoch: int = 0
    slot: int = 0
    offset: int = 0
    index: int = 0
    ordinal: int = 0


class _Raw(NamedTuple):
    """A shard entry before parsing: a JSONL line or a WebDataset sample's members."""

    index: int
    offset: int  # where it starts
    after: int  # where the next entry starts
    content: Any


class _Truncated(NamedTuple):
    """A shard that ends early: what went wrong, and how many whole samples came before; the rest is lost."""

    detail: str
    met: int


@dataclass
class _Parsed:
    """Consecutive entries of one shard, parsed, and their samples measured (CHUNK samples at most)."""

    entries: list[tuple[_Raw | None, int, Any]]  # (entry, its sample's index or -1, payload or skip reason);
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
            after = (-1, -1) if raw is None else (raw.after, raw.index + 1)  # broke off: resume at the next shard
            if i < 0 or sizes.problem[i]:
                items.append((extra if i < 0 else sizes.problem[i], after))
            else:
                sample = extra[0]
                items.append(
                    (
                        Record(
                            [raw.offset, raw.index],
                            0,
                            sample.id,
                            sample.modality,
                            *(c[i] for c in columns),
                            sizes.segment_tokens[i],
                            extra,
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
        self.shards = self.storage.shards(location, self.suffix)
        if not self.shards:
            raise FileNotFoundError(f"{location}: no *{self.suffix} shard found")
        self.identity = f"{location} ({len(self.shards)} shards)"
        self.held: dict[str, int] = {}  # samples per shard, where an index says (a truncated shard's lost ones)

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
    def _entries(self, shard: str, offset: int, index: int) -> Iterator[_Raw | _Truncated]:
        """A shard's entries from byte `offset`, which is entry `index`."""

    @abstractmethod
    def _parse(self, shard: str, raw: _Raw, build: bool) -> tuple[str, str, list[SegmentFields], Any]:
        """(id, modality, segment fields, payload): the payload (sample, where its media are) only if `build`
        (else None, or whatever the source had to build anyway); raises CorruptSample (reason) or ValueError
        (a bad record)."""

    def _chunks(self, view: View, at: Position, build: bool) -> Iterator[tuple[int, int, _Parsed]]:
        """(epoch, slot, parsed entries) over epochs, from `at` on."""
        epoch, slot, offset, index, _ = at
        while True:
            shards, stride = self.plan(view, epoch)
            whole_epoch, records = slot == offset == 0, 0
            for k in range(slot, len(shards)):
                keep = (lambda i: True) if stride == 1 else (lambda i, k=k: (i + k) % stride == view.consumer)
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
        entries: list[tuple[_Raw | None, int, Any]] = []
        modalities: list[int] = []
        rows = SegmentRows()
        logged = 0

        def flush() -> _Parsed:
            nonlocal entries, modalities, rows
            parsed = _Parsed(entries, modalities, measure(rows.segments(), rows.samples, self.cfg))
            entries, modalities, rows = [], [], SegmentRows()
            return parsed

        for raw in self._entries(shard, offset, index):
            if isinstance(raw, _Truncated):
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
            if not keep(raw.index):
                continue
            try:
                sample_id, modality, fields, payload = self._parse(shard, raw, build)
            except (CorruptSample, ValueError) as err:
                reason = err.reason if isinstance(err, CorruptSample) else "bad_record"
                if logged < LOGGED_PER_SHARD:
                    log.warning("%s: skipped entry %d: %s: %s", shard, raw.index + 1, reason, err)
                    logged += 1
                entries.append((raw, -1, reason))
                continue
            if view.split != "all" and in_heldout(sample_id, self.cfg.heldout_fraction) != (view.split == "heldout"):
                continue
            entries.append((raw, rows.samples, payload))
            modalities.append(KIND_CODE[modality])
            rows.add(fields)
            if rows.samples == CHUNK:
                yield flush()
        yield flush()
        if logged == LOGGED_PER_SHARD:
            log.warning("%s: further bad entries were counted, not logged", shard)


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
            if type(item) is Record:
                item.ref = [self._epoch, self._slot, *item.ref, self._ordinal]
                item.ordinal = self._ordinal
                self._ordinal += 1
                return item
            self._on_skip(item)

    def position(self) -> list[int]:
        if self._offset < 0:  # the shard broke off: go on with the next one
            return [self._epoch, self._slot + 1, 0, 0, self._ordinal]
        return [self._epoch, self._slot, self._offset, self._index, self._ordinal]


def decode_media(seg: Segment, data: bytes, cfg: DataConfig) -> Any:
    """A media file's bytes decoded as its segment kind; raises OversizedImage, EmptyAudio, or what the
    decoders raise for bad bytes."""
    if seg.kind == "image":
        return open_image(data, cfg.max_image_pixels)
    if seg.kind == "video":
        return open_video_frames(data, cfg.video_max_frames, cfg.max_image_pixels)
    return read_audio(data)


def media_error(sample_id: str, where: str, err: Exception) -> CorruptSample:
    """The skip reason of a decoding failure."""
    reason = (
        "missing_file"
        if isinstance(err, FileNotFoundError)
        else "oversized_image"
        if isinstance(err, (OversizedImage, Image.DecompressionBombError))
        else "empty_audio"
        if isinstance(err, EmptyAudio)
        else "unreadable_file"
    )
    return CorruptSample(sample_id, where, reason, str(err))


DECODE_ERRORS = (OSError, ValueError, RuntimeError, EOFError, SyntaxError, Image.DecompressionBombError)


# --- JSONL -----------------------------------------------------------------------------------------------


class JsonlSource(ShardedSource):
    """Manifest shards (`*.jsonl`, one metadata record per line); media paths are relative to the manifest's
    folder and read whole on demand, text is inline."""

    suffix = ".jsonl"

    def _entries(self, shard: str, offset: int, index: int) -> Iterator[_Raw]:
        body = self.storage.open(shard, offset)
        try:
            rest = b""
            while block := body.read(1 << 20):
                lines = (rest + block).split(b"\n")
                rest = lines.pop()
                for line in lines:
                    if line.strip():  # blank lines are no record, but keep their line number
                        yield _Raw(index, offset, offset + len(line) + 1, line)
                    offset += len(line) + 1
                    index += 1
            if rest.strip():
                yield _Raw(index, offset, offset + len(rest), rest)
        finally:
            body.close()

    def _parse(self, shard: str, raw: _Raw, build: bool) -> tuple[str, str, list[SegmentFields], Any]:
        try:
            obj = orjson.loads(raw.content)
        except orjson.JSONDecodeError as err:
            raise ValueError(f"not JSON: {err}") from None
        sample_id, modality, fields = record_fields(obj)
        for kind, _, path, *_ in fields:
            if path and kind == "text":
                raise ValueError("text segments of a JSONL manifest are inline ('text'), not files")
            if path and _leaves_folder(path):
                raise CorruptSample(sample_id, path, "unsafe_path", "media paths are relative to the manifest")
        return sample_id, modality, fields, (Sample.of_fields(sample_id, modality, fields), shard) if build else None

    def media(self, record: Record, seg: Segment) -> Any:
        where = self.where(record, seg)
        try:
            return decode_media(seg, self.storage.read(where), self.cfg)
        except DECODE_ERRORS as err:
            raise media_error(record.id, where, err) from err

    def where(self, record: Record, seg: Segment) -> str:
        return join(parent(record.payload[1]), seg.path)


def _leaves_folder(path: str) -> bool:
    """Whether a manifest's media path could name a file outside the manifest's folder."""
    parts = PurePosixPath(path.replace("\\", "/"))
    return parts.is_absolute() or ".." in parts.parts or "://" in path


# --- WebDataset ------------------------------------------------------------------------------------------

IMAGE_EXTS, AUDIO_EXTS, VIDEO_EXTS, TEXT_EXTS = {"png", "jpg", "jpeg", "webp"}, {"wav", "flac"}, {"gif"}, {"txt"}


def split_member(name: str) -> tuple[str, str]:
    """WebDataset naming: the key is the path up to the first dot of the file name, the rest is the extension."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def shard_index(index: str, raw: bytes) -> dict[str, int]:
    """Samples per shard location from a wids index's bytes; a malformed one is refused by file and field."""
    try:
        shardlist = orjson.loads(raw)["shardlist"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{index}: not a wids shard index (JSON with a 'shardlist' list)") from None
    held = {}
    for i, entry in enumerate(shardlist if isinstance(shardlist, list) else [None]):
        url, count = (entry.get("url"), entry.get("nsamples")) if isinstance(entry, dict) else (None, None)
        if not isinstance(url, str) or type(count) is not int or count < 0:
            raise ValueError(f"{index}: shardlist[{i}] needs a 'url' string and a non-negative integer 'nsamples'")
        held[join(parent(index), url)] = count
    return held


class WdsSource(ShardedSource):
    """WebDataset shards (`*.tar`): a sample is the consecutive members sharing a key. `key.json` holds its
    metadata (segments name members by extension: "png", "txt"); without it the segments are inferred from the
    member extensions and sized from the file headers (no pixel or sample is decoded). A `shardindex.json`
    beside the shards (webdataset's wids format: {"shardlist": [{"url": ..., "nsamples": ...}]}, urls
    relative to it) says how many samples each holds, so a truncated shard's lost ones are counted."""

    suffix = ".tar"
    INDEX = "shardindex.json"

    def __init__(self, location: str, cfg: DataConfig) -> None:
        super().__init__(location, cfg)
        index = join(location if not location.endswith(self.suffix) else parent(location), self.INDEX)
        if self.storage.exists(index):
            self.held = shard_index(index, self.storage.read(index))

    def _entries(self, shard: str, offset: int, index: int) -> Iterator[_Raw | _Truncated]:
        body = self.storage.open(shard, offset)
        key, members, start = None, {}, offset
        try:
            with tarfile.open(fileobj=body, mode="r|") as tar:
                for info in tar:
                    if not info.isfile():
                        continue
                    name_key, ext = split_member(info.name)
                    if name_key != key:
                        if key is not None:
                            yield _Raw(index, start, offset + info.offset, (key, members))
                            index += 1
                        key, members, start = name_key, {}, offset + info.offset
                    members[ext] = tar.extractfile(info).read()
                end = offset + tar.offset
            if key is not None:
                yield _Raw(index, start, end, (key, members))
        except (tarfile.TarError, OSError, EOFError) as err:
            yield _Truncated(f"{err} (after {index} samples; the rest of the shard is skipped)", index)
        finally:
            body.close()

    def _parse(self, shard: str, raw: _Raw, build: bool) -> tuple[str, str, list[SegmentFields], Any]:
        """Builds the sample whatever `build` says: checking its members needs it."""
        key, members = raw.content
        where = f"{shard}:{key}"
        if "json" in members:
            try:
                obj = orjson.loads(members["json"])
            except orjson.JSONDecodeError as err:
                raise ValueError(f"{key}.json is not JSON: {err}") from None
            if isinstance(obj, dict):
                obj.setdefault("id", key)
            sample = Sample.from_json(obj)
        else:
            segments = self._inferred_segments(where, key, members)
            sample = Sample(key, modality_of(seg.kind for seg in segments), segments)
        for seg in sample.segments:
            if seg.path and seg.path not in members:
                raise CorruptSample(sample.id, f"{where}.{seg.path}", "missing_file", "no such member")
            if seg.kind == "text" and seg.path:
                try:
                    seg.text = members[seg.path].decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(f"{key}.{seg.path} is not UTF-8: {err}") from None
        return sample.id, sample.modality, [seg.fields() for seg in sample.segments], (sample, (where, members))

    def _inferred_segments(self, where: str, key: str, members: dict[str, bytes]) -> list[Segment]:
        """Media members (by sorted extension) then text members: sizes read from headers."""
        media, texts = [], []
        for ext in sorted(members):
            last = ext.rsplit(".", 1)[-1]
            data = members[ext]
            try:
                if last in IMAGE_EXTS:
                    width, height = image_header(data)
                    media.append(Segment("image", path=ext, width=width, height=height))
                elif last in VIDEO_EXTS:
                    width, height, frames = video_header(data)
                    media.append(Segment("video", path=ext, width=width, height=height, num_frames=frames))
                elif last in AUDIO_EXTS:
                    n, rate = audio_header(data)
                    media.append(Segment("audio", path=ext, num_samples=n, sample_rate=rate))
                elif last in TEXT_EXTS:
                    texts.append(Segment("text", path=ext))
            except DECODE_ERRORS as err:
                raise media_error(key, f"{where}.{ext}", err) from err
        if not media and not texts:
            raise ValueError(f"{key}: no member with a known extension ({', '.join(sorted(members))})")
        return media + texts

    def media(self, record: Record, seg: Segment) -> Any:
        try:
            return decode_media(seg, record.payload[1][1][seg.path], self.cfg)
        except DECODE_ERRORS as err:
            raise media_error(record.id, self.where(record, seg), err) from err

    def where(self, record: Record, seg: Segment) -> str:
        return f"{record.payload[1][0]}.{seg.path}"
