"""Conversation records in one form: LLaVA, ShareGPT and OpenAI-style `messages` records become OpenAI-style
messages whose media parts are bare markers ({"type": "image"}), plus the media they stand for, in order.

The formats (docs/data.md has examples):
- LLaVA / ShareGPT: `conversations` [{"from": "human" | "gpt" | "system", "value": str}], media named by
  `image` / `images` (also `audio(s)`, `video(s)`) and placed by `<image>` (`<audio>`, `<video>`) markers.
- ShareGPT with `messages` [{"role", "content": str}]: the same markers and media keys.
- OpenAI `messages` whose content is a list of typed parts: {"type": "text", "text"}, and media parts
  that name their file ({"type": "image", "image": path} or "path") or, bare, take the next entry of the
  record's media list as a marker does.
A media entry is a path or {"path", sizes}: with `width`/`height` (video: also `num_frames`; audio:
`num_samples`/`sample_rate`) no file is opened to count tokens; without, the file's header is read.

A record that cannot be trained on raises CorruptSample with a reason of source_base.SKIP_REASONS.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from omni_core.common.tokenizer import Tokenizer
from omni_core.data.audio import audio_header
from omni_core.data.chat import render_conversation
from omni_core.data.image import image_header, video_header
from omni_core.data.media_decode import DECODE_ERRORS, media_error
from omni_core.data.sample import Rendered, Segment, segment_fields
from omni_core.data.source_base import CorruptSample, leaves_folder

MEDIA_KINDS = ("image", "audio", "video")
MARKER = re.compile(r"<(image|audio|video)>")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# the sizes a media entry may carry, per kind (sample.py's metadata keys)
SIZE_KEYS = {
    "image": ("width", "height"),
    "video": ("width", "height", "num_frames"),
    "audio": ("num_samples", "sample_rate"),
}
RecordFormat = Literal["segments", "conversation"]
Render = Callable[[list[dict[str, Any]]], Rendered]  # messages -> ids and loss mask (the recipe's chat template)


def chat_renderer(tokenizer: Tokenizer, train_on_prompt: bool) -> Render | None:
    """Conversations rendered with the tokenizer's chat template (data/chat.py); None for a tokenizer without
    one (the byte tokenizer), which reads segment records only.

    A conversation's document is the template's rendering as is, so training sees the ids `apply_chat_template`
    gives at inference: the template alone decides on a BOS. One EOS is appended only where the rendering holds
    none of the tokenizer's (a base model's EOS under a chat template that ends turns otherwise), so that the
    model still learns to stop in the tokenizer's own terms; it is trained when the conversation ends trained."""
    if tokenizer.chat_template is None:
        return None
    placeholders = set(tokenizer.placeholder_ids.values())
    eos = tokenizer.eos_id

    def render(messages: list[dict[str, Any]]) -> Rendered:
        out = render_conversation(tokenizer, messages, train_on_prompt=train_on_prompt)
        ids, trainable = list(out.ids), list(out.trainable)
        if eos not in ids:
            ids.append(eos)
            trainable.append(bool(trainable) and trainable[-1])
        return Rendered(ids, trainable, [i for i, t in enumerate(ids) if t in placeholders])

    return render


class NoRenderer(ValueError):
    """Conversation records met by a source that has no chat template to render them with: a setup error
    (a launch check's finding), never a skipped record."""


@dataclass(frozen=True, slots=True)
class MediaRef:
    """A media file a conversation names: `sizes` holds the record's size keys, empty when it gives none."""

    kind: str
    path: str
    sizes: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Conversation:
    id: str
    messages: list[dict[str, Any]]  # OpenAI form; a message with media has a list of parts, else a string
    media: list[MediaRef]  # in the order their markers appear

    @property
    def modality(self) -> str:
        """The loss bucket: the first media's kind, as for segment samples."""
        return self.media[0].kind if self.media else "text"


def record_format(obj: Any, setting: str) -> RecordFormat:
    """The format a record is read as: data.format's, or under `auto` the one its keys show; raises ValueError
    for a record of neither (a malformed one: bad_record)."""
    if setting != "auto":
        return "segments" if setting == "segments" else "conversation"
    if type(obj) is dict and "segments" in obj:
        return "segments"
    if type(obj) is dict and ("conversations" in obj or "messages" in obj):
        return "conversation"
    raise ValueError("record has none of 'segments', 'conversations', 'messages' (data.format: auto)")


def record_id(obj: dict[str, Any]) -> str:
    """The record's `id` (a string or an integer), else a hash of its content: stable when the data is reordered,
    so the held-out split keeps it on its side."""
    given = obj.get("id")
    if type(given) is str and given:
        return given
    if type(given) is int:
        return str(given)
    return "sha1-" + hashlib.sha1(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def parse_conversation(obj: Any, unlisted: Mapping[str, list[str]] | None = None) -> Conversation:
    """The record as messages and media; raises CorruptSample (its reason) for one that cannot be trained on.
    `unlisted`: per kind, the paths its markers take when the record lists no media of that kind (a WebDataset
    sample's members), any left over being no mismatch."""
    if type(obj) is not dict:
        raise ValueError("record is not a JSON object")
    sample_id = record_id(obj)
    turns, key = (
        (obj["conversations"], "conversations") if "conversations" in obj else (obj.get("messages"), "messages")
    )
    if type(turns) is not list:
        raise CorruptSample(sample_id, key, "bad_record", "needs a list of turns")
    if not turns:
        raise CorruptSample(sample_id, key, "empty_conversation")
    listed = {kind: _listed_media(sample_id, obj, kind) for kind in MEDIA_KINDS}
    fallback = {
        kind: [MediaRef(kind, path) for path in paths]
        for kind, paths in (unlisted or {}).items()
        if kind not in obj and f"{kind}s" not in obj
    }
    reader = _Reader(sample_id, listed, fallback)
    system = obj.get("system")
    messages = [{"role": "system", "content": system}] if type(system) is str and system else []
    for i, turn in enumerate(turns):
        messages.append(reader.message(turn, f"{key}[{i}]"))
    for kind, left in listed.items():
        if left:
            raise CorruptSample(
                sample_id, f"{kind}s", "media_marker_mismatch", f"{len(left)} {kind}(s) without a <{kind}> marker"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise CorruptSample(sample_id, key, "no_assistant_turn")
    return Conversation(sample_id, messages, reader.media)


class _Reader:
    """Turns one record's turns into messages, taking listed media as their markers come."""

    def __init__(self, sample_id: str, listed: dict[str, list[MediaRef]], fallback: dict[str, list[MediaRef]]) -> None:
        self.sample_id, self.listed, self.fallback = sample_id, listed, fallback
        self.media: list[MediaRef] = []

    def message(self, turn: Any, where: str) -> dict[str, Any]:
        if type(turn) is not dict:
            raise CorruptSample(self.sample_id, where, "bad_record", "a turn is a JSON object")
        speaker, content = (
            (turn.get("from"), turn.get("value")) if "from" in turn else (turn.get("role"), turn.get("content"))
        )
        role = ROLES.get(speaker) if type(speaker) is str else None
        if role is None:
            raise CorruptSample(self.sample_id, where, "unknown_role", f"{speaker!r} (known: {', '.join(ROLES)})")
        if type(content) is str:
            parts = self._split_markers(content, where)
        elif type(content) is list and "from" not in turn:
            parts = [self._part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
        else:
            raise CorruptSample(self.sample_id, where, "bad_record", "content is a string or a list of typed parts")
        if all(p["type"] == "text" for p in parts):
            return {"role": role, "content": "".join(p["text"] for p in parts)}
        return {"role": role, "content": parts}

    def _split_markers(self, text: str, where: str) -> list[dict[str, Any]]:
        """Text with `<image>`-style markers as parts; text beside a marker is stripped (LLaVA's "<image>\\n")."""
        pieces = MARKER.split(text)
        if len(pieces) == 1:
            return [{"type": "text", "text": text}]
        parts: list[dict[str, Any]] = []
        for j, piece in enumerate(pieces):
            if j % 2:
                parts.append(self._take(piece, where))
            elif piece.strip():
                parts.append({"type": "text", "text": piece.strip()})
        return parts

    def _take(self, kind: str, where: str) -> dict[str, Any]:
        """A marker's media: the next one the record lists (or, listing none, the next fallback)."""
        queue = self.listed[kind] or self.fallback.get(kind, [])
        if not queue:
            raise CorruptSample(self.sample_id, where, "media_marker_mismatch", f"a <{kind}> marker without its {kind}")
        self.media.append(queue.pop(0))
        return {"type": kind}

    def _part(self, part: Any, where: str) -> dict[str, Any]:
        kind = part.get("type") if type(part) is dict else None
        if kind == "text" and type(part.get("text")) is str:
            return {"type": "text", "text": part["text"]}
        if kind == "image_url":  # OpenAI's form; the url is a path here (a web or data: url is unsafe_path)
            url = part["image_url"].get("url") if type(part.get("image_url")) is dict else None
            if type(url) is not str:
                raise CorruptSample(self.sample_id, where, "bad_record", "an image_url part needs an 'image_url.url'")
            part, kind = {"type": "image", "path": url}, "image"
        if kind not in MEDIA_KINDS:
            raise CorruptSample(self.sample_id, where, "bad_record", "a part's type is text, image, audio or video")
        path = part.get("path", part.get(kind))
        if path is None:
            return self._take(kind, where)
        self.media.append(_media_ref(self.sample_id, kind, part | {"path": path}, where))
        return {"type": kind}


def _listed_media(sample_id: str, obj: dict[str, Any], kind: str) -> list[MediaRef]:
    """The record's top-level media of a kind: `image` (one) or `images` (a list)."""
    one, many = obj.get(kind), obj.get(f"{kind}s")
    if one is not None and many is not None:
        raise CorruptSample(sample_id, kind, "bad_record", f"both '{kind}' and '{kind}s'")
    entries = [one] if one is not None else many if many is not None else []
    if type(entries) is not list:
        raise CorruptSample(sample_id, f"{kind}s", "bad_record", "a list of paths or {'path', sizes} objects")
    return [_media_ref(sample_id, kind, entry, f"{kind}s[{i}]") for i, entry in enumerate(entries)]


def _media_ref(sample_id: str, kind: str, entry: Any, where: str) -> MediaRef:
    """A media entry checked: a safe relative path, and its sizes all or none."""
    path = entry.get("path") if type(entry) is dict else entry
    if type(path) is not str or not path:
        raise CorruptSample(sample_id, where, "bad_record", f"an {kind} is a path or an object with a 'path'")
    if leaves_folder(path):
        raise CorruptSample(sample_id, path, "unsafe_path", "media paths are relative to data.media_root")
    keys = SIZE_KEYS[kind]
    given = {key: entry[key] for key in keys if type(entry) is dict and key in entry}
    if given and (len(given) < len(keys) or any(type(v) is not int or v < 0 for v in given.values())):
        raise CorruptSample(sample_id, where, "bad_record", f"sizes are all of {', '.join(keys)} (integers) or none")
    return MediaRef(kind, path, given)


def media_segment(sample_id: str, ref: MediaRef, path: str, data: bytes | None) -> Segment:
    """The media's segment at `path`: sized by the record, else by the header of `data` (the file's bytes);
    raises CorruptSample (a file that does not open) or ValueError (sizes out of range: bad_record)."""
    if data is None:
        kind, _, _, width, height, num_samples, sample_rate, num_frames = segment_fields(
            {"type": ref.kind, "path": path} | ref.sizes
        )
        return Segment(kind, "", path, width, height, num_samples, sample_rate, num_frames)
    try:
        if ref.kind == "image":
            width, height = image_header(data)
            return Segment("image", path=path, width=width, height=height)
        if ref.kind == "video":
            width, height, frames = video_header(data)
            return Segment("video", path=path, width=width, height=height, num_frames=frames)
        num_samples, rate = audio_header(data)
        return Segment("audio", path=path, num_samples=num_samples, sample_rate=rate)
    except DECODE_ERRORS as err:
        raise media_error(sample_id, ref.path, err) from err
