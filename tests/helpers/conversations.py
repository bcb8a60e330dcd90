"""A small LLaVA-format dataset of generated PNG images (a coloured box on white) with questions and answers, and
the same conversations as ShareGPT and OpenAI `messages` records; written as a `.json` array, as `.jsonl` and
as a WebDataset shard. `byte_chatml` renders messages ChatML-style over the byte tokenizer: a renderer for the
sources' tests that needs no tokenizer files."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

from PIL import Image

from omni_core.common.tokenizer import PLACEHOLDER_IDS, ByteTokenizer
from omni_core.data.sample import Rendered

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220), "yellow": (230, 220, 20)}
SIZES = [(24, 16), (16, 32), (40, 24), (32, 32)]
ROLES = {"human": "user", "gpt": "assistant"}


def png(colour: str, size: tuple[int, int]) -> bytes:
    img = Image.new("RGB", size, (255, 255, 255))
    img.paste(COLOURS[colour], (size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def llava_records(count: int) -> list[dict[str, Any]]:
    """LLaVA records (two turns each) and, under "_png", each record's image bytes."""
    records = []
    for i in range(count):
        colour, size = list(COLOURS)[i % len(COLOURS)], SIZES[i % len(SIZES)]
        records.append(
            {
                "id": f"conv-{i:04d}",
                "image": f"images/{i:04d}.png",
                "conversations": [
                    {"from": "human", "value": "<image>\nWhat colour is the box?"},
                    {"from": "gpt", "value": f"It is {colour}."},
                    {"from": "human", "value": "How wide is the picture?"},
                    {"from": "gpt", "value": f"{size[0]} pixels."},
                ],
                "_png": png(colour, size),
            }
        )
    return records


def sharegpt(record: dict[str, Any]) -> dict[str, Any]:
    """The LLaVA record as ShareGPT `messages` (role/content strings with markers, `images` list)."""
    return {
        "id": record["id"],
        "images": [record["image"]],
        "messages": [{"role": ROLES[t["from"]], "content": t["value"]} for t in record["conversations"]],
    }


def openai(record: dict[str, Any]) -> dict[str, Any]:
    """The LLaVA record as OpenAI `messages` with typed parts; the image part names its file."""
    turns = record["conversations"]
    first = [{"type": "image", "image": record["image"]}, {"type": "text", "text": turns[0]["value"].split("\n", 1)[1]}]
    messages = [{"role": "user", "content": first}] + [
        {"role": ROLES[turn["from"]], "content": [{"type": "text", "text": turn["value"]}]} for turn in turns[1:]
    ]
    return {"id": record["id"], "messages": messages}


def write_media(root: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Writes each record's image under root; the records without their bytes."""
    for record in records:
        (root / record["image"]).parent.mkdir(parents=True, exist_ok=True)
        (root / record["image"]).write_bytes(record["_png"])
    return [{k: v for k, v in r.items() if k != "_png"} for r in records]


def write_llava(root: Path, count: int = 12) -> dict[str, Path]:
    """The dataset as `llava.json` (an array), `llava.jsonl` and `shards/llava-0.tar`; images under root."""
    root.mkdir(parents=True, exist_ok=True)
    records = llava_records(count)
    plain = write_media(root, records)
    (root / "llava.json").write_text(json.dumps(plain, indent=1))
    (root / "llava.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plain))
    (root / "shards").mkdir(exist_ok=True)
    with tarfile.open(root / "shards" / "llava-0.tar", "w") as tar:
        for record, bare in zip(records, plain):
            for ext, data in (("json", json.dumps(bare).encode()), ("png", record["_png"])):
                info = tarfile.TarInfo(f"{record['id']}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return {"json": root / "llava.json", "jsonl": root / "llava.jsonl", "wds": root / "shards" / "llava-0.tar"}


BYTES = ByteTokenizer()


def byte_chatml(messages: list[dict[str, Any]]) -> Rendered:
    """ChatML over bytes: "<|role|>\\n" + content + "\\n" per message; a reply's content and its newline are
    trained; each media part is its placeholder id."""
    ids: list[int] = []
    trainable: list[bool] = []
    media_at: list[int] = []

    def add(text: str, trained: bool) -> None:
        encoded = BYTES.encode(text)
        ids.extend(encoded)
        trainable.extend([trained] * len(encoded))

    for message in messages:
        reply = message["role"] == "assistant"
        add(f"<|{message['role']}|>\n", False)
        content = message["content"]
        for part in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            if part["type"] == "text":
                add(part["text"], reply)
            else:
                media_at.append(len(ids))
                ids.append(PLACEHOLDER_IDS[part["type"]])
                trainable.append(False)
        add("\n", reply)
    return Rendered(ids, trainable, media_at)
