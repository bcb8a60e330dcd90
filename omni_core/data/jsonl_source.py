"""JSONL manifests as a source: shards of one metadata record per line, media files beside them, read whole on
demand; a media path that could leave the manifest's folder is refused unread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Any

import orjson

from omni_core.data.media_decode import DECODE_ERRORS, decode_media, media_error
from omni_core.data.sample import Sample, Segment, SegmentFields, record_fields
from omni_core.data.source_base import CorruptSample, Record
from omni_core.data.sources import Entry, ShardedSource
from omni_core.data.storage import join, parent


class JsonlSource(ShardedSource):
    """Manifest shards (`*.jsonl`, one metadata record per line); media paths are relative to the manifest's
    folder and read whole on demand, text is inline."""

    suffix = ".jsonl"

    def _entries(self, shard: str, offset: int, index: int) -> Iterator[Entry]:
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

    def _parse(self, shard: str, raw: Entry, build: bool) -> tuple[str, str, list[SegmentFields], Any]:
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
