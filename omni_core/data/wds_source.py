"""WebDataset tar shards as a source: a sample is the consecutive members sharing a key, described by its
`key.json` or inferred from its members' extensions and headers; a wids `shardindex.json` beside the shards
lets a truncated shard's lost samples be counted."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from typing import Any

import orjson

from omni_core.data.audio import audio_header
from omni_core.data.conversation import MediaRef, record_format
from omni_core.data.image import image_header, video_header
from omni_core.data.media_decode import DECODE_ERRORS, decode_media, media_error
from omni_core.data.sample import Sample, Segment, modality_of
from omni_core.data.source_base import CorruptSample, Record
from omni_core.data.sources import Entry, Parsed, ShardedSource, Truncated
from omni_core.data.storage import join, parent
from omni_core.recipe.data_sections import DataConfig

IMAGE_EXTS, AUDIO_EXTS, VIDEO_EXTS, TEXT_EXTS = {"png", "jpg", "jpeg", "webp"}, {"wav", "flac"}, {"gif"}, {"txt"}
MEDIA_EXTS = {"image": IMAGE_EXTS, "audio": AUDIO_EXTS, "video": VIDEO_EXTS}


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

    def _entries(self, shard: str, offset: int, index: int) -> Iterator[Entry | Truncated]:
        body = self.storage.open(shard, offset)
        key: str | None = None
        members: dict[str, bytes] = {}
        start = offset
        try:
            with tarfile.open(fileobj=body, mode="r|") as tar:
                for info in tar:
                    if not info.isfile():
                        continue
                    name_key, ext = split_member(info.name)
                    if name_key != key:
                        if key is not None:
                            yield Entry(index, start, offset + info.offset, (key, members))
                            index += 1
                        key, members, start = name_key, {}, offset + info.offset
                    member_file = tar.extractfile(info)
                    assert member_file is not None  # a regular file (isfile above) always has a body
                    members[ext] = member_file.read()
                end = offset + tar.offset
            if key is not None:
                yield Entry(index, start, end, (key, members))
        except (tarfile.TarError, OSError, EOFError) as err:
            yield Truncated(f"{err} (after {index} samples; the rest of the shard is skipped)", index)
        finally:
            body.close()

    def _parse(self, shard: str, raw: Entry, build: bool) -> Parsed:
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
            if record_format(obj, self.cfg.format) == "conversation":
                unlisted = {
                    kind: [ext for ext in sorted(members) if ext.rsplit(".", 1)[-1] in exts]
                    for kind, exts in MEDIA_EXTS.items()
                }
                return self._conversation(obj, (where, members), _MemberPicker(where, members).pick, unlisted)
            sample = Sample.from_json(obj)
        elif self.cfg.format == "conversation":
            raise ValueError(f"{key}: data.format is conversation but the sample has no {key}.json")
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
        return Parsed(sample.id, sample.modality, [seg.fields() for seg in sample.segments], (sample, (where, members)))

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


class _MemberPicker:
    """A conversation's media among its sample's members: a media path that names a member's extension ("jpg",
    "1.png") is that member; any other (the file name the record was made from) takes the next member of its
    kind not named, in extension order."""

    def __init__(self, where: str, members: dict[str, bytes]) -> None:
        self.where, self.members = where, members
        self.taken: set[str] = set()

    def pick(self, sample_id: str, ref: MediaRef) -> tuple[str, bytes | None]:
        ext = ref.path if ref.path in self.members else None
        if ext is None:
            kind_exts = MEDIA_EXTS[ref.kind]
            free = [e for e in sorted(self.members) if e.rsplit(".", 1)[-1] in kind_exts and e not in self.taken]
            if not free:
                raise CorruptSample(sample_id, f"{self.where}.{ref.path}", "missing_file", f"no {ref.kind} member")
            ext = free[0]
        self.taken.add(ext)
        return ext, None if ref.sizes else self.members[ext]
