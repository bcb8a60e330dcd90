"""JSON manifests as a source: shards of one metadata record per line (`*.jsonl`), or a `.json` file holding an
array of records (LLaVA's `llava_instruct.json`); media files beside them or under data.media_root, read whole
on demand; a media path that could leave that folder is refused unread."""

from __future__ import annotations

import mmap
import re
from collections.abc import Iterator
from typing import Any

import orjson

from omni_core.data.conversation import MediaRef, record_format
from omni_core.data.image import image_header
from omni_core.data.media_decode import DECODE_ERRORS, decode_media, media_error
from omni_core.data.sample import Sample, Segment, record_fields
from omni_core.data.source_base import CorruptSample, Record, leaves_folder
from omni_core.data.sources import Entry, Parsed, ShardedSource
from omni_core.data.storage import join, parent

ARRAY_SUFFIX = ".json"
IMAGE_HEADER_BYTES = 1 << 16  # read to size an image whose record gives no width/height (a PNG needs 33)
# what a JSON array's top level is scanned by: whole strings (skipped over), brackets and commas
_ARRAY_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},]')
_SPACE = b" \t\r\n"
_NOT_SPACE = re.compile(rb"[^ \t\r\n]")


class JsonlSource(ShardedSource):
    """Manifest shards (`*.jsonl`, one metadata record per line, or a `.json` array of records named as the
    location); media paths are relative to data.media_root, else the manifest's folder, and read whole on
    demand; text is inline. Records are omni's segment records or conversations (data.format)."""

    suffix = ".jsonl"
    _kept: tuple[str, bytes | mmap.mmap] | None = None  # the .json array file last read, and its bytes

    def _shards(self, location: str) -> list[str]:
        if location.endswith(ARRAY_SUFFIX):
            if not self.storage.exists(location):
                raise FileNotFoundError(f"{location}: no such file")
            return [location]
        return super()._shards(location)

    def _entries(self, shard: str, offset: int, index: int) -> Iterator[Entry]:
        if shard.endswith(ARRAY_SUFFIX):
            yield from _array_entries(shard, self._array(shard), offset, index)
            return
        body = self.storage.open(shard, offset)
        try:
            rest = b""
            while block := body.read(1 << 20):
                lines = (rest + block).split(b"\n")
                rest = lines.pop()
                for line in lines:
                    if line.strip():  # blank lines are no record, but keep their line number
                        yield Entry(index, offset, offset + len(line) + 1, line)
                    offset += len(line) + 1
                    index += 1
            if rest.strip():
                yield Entry(index, offset, offset + len(rest), rest)
        finally:
            body.close()

    def __getstate__(self) -> dict[str, Any]:
        """Sent to a loader worker without the kept array: the worker reads it once itself."""
        return {key: value for key, value in self.__dict__.items() if key != "_kept"}

    def _array(self, shard: str) -> bytes | mmap.mmap:
        """A `.json` array file's bytes (memory-mapped where local: `Storage.view`), kept while it is the one
        read: every epoch and every refetched record (a resumed loader's pending ones) would read it again."""
        if self._kept is None or self._kept[0] != shard:
            self._kept = (shard, self.storage.view(shard))
        return self._kept[1]

    def _parse(self, shard: str, raw: Entry, build: bool) -> Parsed:
        try:
            obj = orjson.loads(raw.content)
        except orjson.JSONDecodeError as err:
            raise ValueError(f"not JSON: {err}") from None
        if record_format(obj, self.cfg.format) == "conversation":
            return self._conversation(obj, shard, lambda sample_id, ref: self._media_file(shard, sample_id, ref))
        sample_id, modality, fields = record_fields(obj)
        for kind, _, path, *_ in fields:
            if path and kind == "text":
                raise ValueError("text segments of a JSONL manifest are inline ('text'), not files")
            if path and leaves_folder(path):
                raise CorruptSample(sample_id, path, "unsafe_path", "media paths are relative to the manifest")
        payload = (Sample.of_fields(sample_id, modality, fields), shard) if build else None
        return Parsed(sample_id, modality, fields, payload)

    def _media_file(self, shard: str, sample_id: str, ref: MediaRef) -> tuple[str, bytes | None]:
        """A conversation's media: its path as the record gives it, and the file's bytes if it must be sized."""
        if ref.sizes:
            return ref.path, None
        where = join(self._root(shard), ref.path)
        try:
            if ref.kind == "image":  # its size is in its first bytes (unless a large metadata block comes first)
                body = self.storage.open(where)
                try:
                    head = body.read(IMAGE_HEADER_BYTES)
                finally:
                    body.close()
                if _sized_image(head):
                    return ref.path, head
            return ref.path, self.storage.read(where)
        except DECODE_ERRORS as err:
            raise media_error(sample_id, where, err) from err

    def _root(self, manifest: str) -> str:
        """The folder media paths are relative to."""
        return self.cfg.media_root or parent(manifest)

    def media(self, record: Record, seg: Segment) -> Any:
        where = self.where(record, seg)
        try:
            return decode_media(seg, self.storage.read(where), self.cfg)
        except DECODE_ERRORS as err:
            raise media_error(record.id, where, err) from err

    def where(self, record: Record, seg: Segment) -> str:
        return join(self._root(record.payload[1]), seg.path)


def _sized_image(head: bytes) -> bool:
    """Whether an image's first bytes hold its size."""
    try:
        image_header(head)
    except DECODE_ERRORS:
        return False
    return True


def _array_entries(shard: str, data: bytes | mmap.mmap, offset: int, index: int) -> Iterator[Entry]:
    """The elements of a JSON array file from byte `offset` (0, or just after an element's comma), each as an
    entry; a file that is no JSON array, or ends inside it, is an error naming the file."""
    at = offset
    if not offset:
        first = _NOT_SPACE.search(data)
        at = first.start() if first else len(data)
        if data[at : at + 1] != b"[":
            raise ValueError(f"{shard}: not a JSON array of records (a .json source holds one array)")
        at += 1
    depth, start = 1, at
    for token in _ARRAY_TOKEN.finditer(data, at):
        mark = token.group()
        if mark in (b"[", b"{"):
            depth += 1
        elif mark in (b"]", b"}"):
            depth -= 1
        if depth == 0 or (depth == 1 and mark == b","):
            element = data[start : token.start()].strip(_SPACE)
            if element:
                yield Entry(index, start, token.end(), element)
            elif mark == b",":
                raise ValueError(f"{shard}: an empty element before byte {token.start()} of the JSON array")
            if depth == 0:
                return
            index, start = index + 1, token.end()
    raise ValueError(f"{shard}: the JSON array ends unclosed (truncated file?)")
