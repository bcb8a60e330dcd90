"""Conversation records (LLaVA, ShareGPT, OpenAI messages): one normal form, read from .json arrays, .jsonl and
WebDataset shards, loss only on the replies, and bad records skipped and counted by reason."""

from __future__ import annotations

import io
import json
import mmap
import pickle
import re
import tarfile
from collections import Counter
from itertools import groupby, pairwise
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from omni_core.common.tokenizer import EOS_ID, IMAGE_ID, ByteTokenizer, HFTokenizer
from omni_core.data.conversation import NoRenderer, parse_conversation
from omni_core.data.dataset import ManifestDataset, open_source
from omni_core.data.flops import FlopModel
from omni_core.data.jsonl_source import JsonlSource
from omni_core.data.loader import PackedLoader
from omni_core.data.packing import IGNORE, collate
from omni_core.data.profile import profile_source
from omni_core.data.sample import record_fields, token_ids, trainable_mask
from omni_core.data.source_base import CorruptSample, Record, View
from omni_core.data.wds_source import WdsSource
from omni_core.recipe.data_sections import DataConfig
from tests.helpers.conversations import byte_chatml, llava_records, openai, png, sharegpt, write_llava
from tests.helpers.data_sources import records as helper_records
from tests.helpers.hf_tokenizer import write_tokenizer
from tests.helpers.recipes import build_recipe

BYTES = ByteTokenizer()


def read(location: Path, source: str = "jsonl", **settings) -> tuple[list[Record], Counter[str], object]:
    cfg = DataConfig(source=source, **settings)
    src = (WdsSource if source == "wds" else JsonlSource)(str(location), cfg)  # open_source, with byte_chatml
    src.render = byte_chatml
    skipped: list[str] = []
    stream = src.stream(View(0, 1, "all", 0, one_pass=True, shuffle=False), None, skipped.append)
    return list(iter(lambda: stream.next(0), None)), Counter(skipped), src


def test_every_format_gives_the_same_messages():
    record = {k: v for k, v in llava_records(1)[0].items() if k != "_png"}
    llava, share, oai = (parse_conversation(r) for r in (record, sharegpt(record), openai(record)))
    assert llava.messages == share.messages == oai.messages
    assert llava.media == share.media == oai.media and [m.path for m in llava.media] == [record["image"]]
    assert llava.messages[0] == {
        "role": "user",
        "content": [{"type": "image"}, {"type": "text", "text": "What colour is the box?"}],
    }
    assert llava.messages[1] == {"role": "assistant", "content": "It is red."}


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> dict[str, Path]:
    return write_llava(tmp_path_factory.mktemp("llava"))


def test_a_json_array_a_jsonl_and_a_shard_load_the_same(llava):
    got = {kind: read(path, "wds" if kind == "wds" else "jsonl")[:2] for kind, path in llava.items()}
    summary = {kind: [(r.id, r.modality, r.tokens, r.segment_tokens) for r in recs] for kind, (recs, _) in got.items()}
    assert summary["json"] == summary["jsonl"] == summary["wds"] and len(summary["json"]) == 12
    assert all(not skips for _, skips in got.values())
    first = got["json"][0][0]
    assert first.modality == "image" and first.image_items == 1 and first.segment_tokens[0] == 2 * 3  # 24x16 at 8 px


def test_decoded_conversations_train_only_on_the_replies(llava):
    records, _, src = read(llava["json"])
    by_id = {r["id"]: r for r in json.loads(llava["json"].read_text())}
    for record in records:
        sample = src.sample(record)
        ids, mask = token_ids(sample, record.segment_tokens), trainable_mask(sample, record.segment_tokens)
        assert mask is not None and len(mask) == len(ids) == record.tokens
        assert ids.count(IMAGE_ID) == record.image_llm == record.segment_tokens[0]
        assert (
            not any(m for i, m in zip(ids, mask) if i == IMAGE_ID) and mask[-1]
        )  # the last reply's newline is trained
        runs = "".join(BYTES.decode([i]) if m else "|" for i, m in zip(ids, mask)).split("|")
        replies = [t["value"] + "\n" for t in by_id[record.id]["conversations"] if t["from"] == "gpt"]
        assert [run for run in runs if run] == replies


def test_media_sizes_come_from_the_record_or_the_file_header(tmp_path):
    write_llava(tmp_path, 2)
    records = json.loads((tmp_path / "llava.json").read_text())
    records[0]["image"] = {"path": records[0]["image"], "width": 80, "height": 80}  # trusted: no file is opened
    (tmp_path / "sized.json").write_text(json.dumps(records))
    got, skips, _ = read(tmp_path / "sized.json")
    assert not skips and [r.segment_tokens[0] for r in got] == [64, 2 * 4]  # 80x80: 10x10 patches, capped at 64; 16x32


BAD = {
    "empty_conversation": {"id": "a", "conversations": []},
    "no_assistant_turn": {"id": "b", "conversations": [{"from": "human", "value": "hello?"}]},
    "unknown_role": {"id": "c", "conversations": [{"from": "tool", "value": "{}"}, {"from": "gpt", "value": "ok"}]},
    "media_marker_mismatch": {
        "id": "d",
        "conversations": [{"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "x"}],
    },
    "unsafe_path": {
        "id": "e",
        "image": "../secret.png",
        "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}],
    },
    "missing_file": {
        "id": "f",
        "image": "absent.png",
        "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}],
    },
    "bad_record": {"id": "g", "conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]},
}


def test_each_malformed_conversation_is_skipped_and_counted_by_reason(tmp_path):
    write_llava(tmp_path, 1)
    unmarked = {
        "id": "h",
        "image": "images/0000.png",
        "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}],
    }
    good = json.loads((tmp_path / "llava.json").read_text())
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*BAD.values(), unmarked, *good]))
    got, skips, _ = read(tmp_path / "bad.jsonl")
    assert [r.id for r in got] == ["conv-0000"]
    assert skips == Counter({**dict.fromkeys(BAD, 1), "media_marker_mismatch": 2})
    for reason, record in BAD.items():
        if reason not in ("missing_file", "bad_record"):
            with pytest.raises(CorruptSample, match=reason):
                parse_conversation(record)


def test_a_json_file_that_is_no_array_is_an_error_naming_it(tmp_path):
    for name, text in (("object.json", '{"id": "x"}'), ("cut.json", '[{"id": "x", "conversations": []}, {"id"')):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=name):
            read(tmp_path / name)


def test_an_array_resumes_at_a_saved_position(llava):
    cfg = DataConfig(source="jsonl")
    src = open_source(str(llava["json"]), cfg)
    src.render = byte_chatml
    view = View(0, 1, "all", 0, one_pass=True, shuffle=False)
    stream = src.stream(view, None, lambda reason: None)
    first = [stream.next(0) for _ in range(5)]
    resumed = src.stream(view, stream.position(), lambda reason: None)
    rest = list(iter(lambda: resumed.next(0), None))
    assert [r.id for r in first + rest] == [f"conv-{i:04d}" for i in range(12)]
    reads = Counter()
    view_file = src.storage.view
    src.storage.view = lambda location: reads.update([location]) or view_file(location)
    src._kept = None
    assert [src.refetch(view, r.ref).id for r in first] == [r.id for r in first]
    assert reads[str(llava["json"])] == 1  # mapped once, not once per refetched record
    assert isinstance(src._kept[1], mmap.mmap)  # a local array is shared through the page cache, not copied
    assert "_kept" not in pickle.loads(pickle.dumps(src)).__dict__


def test_conversations_need_a_renderer(llava):
    src = open_source(str(llava["jsonl"]), DataConfig(source="jsonl"))
    with pytest.raises(NoRenderer, match="chat template"):
        src.check_usable()


def test_a_packed_batch_has_loss_only_on_the_replies(llava):
    dataset = ManifestDataset(llava["jsonl"], DataConfig(source="jsonl", seq_len=1024))
    dataset.source.render = byte_chatml
    records = helper_records(dataset)[:4]
    docs = [dataset.decode(r) for r in records]
    batch = collate([docs[:2], docs[2:]], dataset.cfg)
    targets = batch.labels[batch.labels != IGNORE].tolist()
    by_id = {r["id"]: r for r in map(json.loads, llava["jsonl"].read_text().splitlines())}
    replies = [t["value"] + "\n" for r in records for t in by_id[r.id]["conversations"] if t["from"] == "gpt"]
    # the documents are the renderings as they are: byte_chatml's ends turns with a newline and writes no EOS
    assert BYTES.decode(targets) == "".join(replies) and targets.count(EOS_ID) == 0
    assert len(batch.image_grids) == 4 and (batch.input_ids == IMAGE_ID).sum() == sum(r.image_llm for r in records)


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_the_llm_tokenizers_chat_template_renders_the_records(llava, tmp_path, train_on_prompt):
    tokenizer = HFTokenizer.from_pretrained(write_tokenizer(tmp_path / "tok", "chatml"))
    cfg = DataConfig(source="jsonl", train_on_prompt=train_on_prompt)
    source = open_source(str(llava["json"]), cfg, tokenizer)
    skipped: list[str] = []
    stream = source.stream(View(0, 1, "all", 0, one_pass=True, shuffle=False), None, skipped.append)
    records = list(iter(lambda: stream.next(0), None))
    assert len(records) == 12 and not skipped
    image = tokenizer.placeholder_ids["image"]
    for record in records:
        rendered = source.sample(record).rendered
        assert rendered is not None and [rendered.ids[i] for i in rendered.media_at] == [image]
        trained = [i for i, m in zip(rendered.ids, rendered.trainable) if m]
        if train_on_prompt:
            assert trained == rendered.ids
            continue
        text = tokenizer.decode(trained, skip_special_tokens=True)
        conv = next(r for r in json.loads(llava["json"].read_text()) if r["id"] == record.id)["conversations"]
        assert text.split() == " ".join(t["value"] for t in conv if t["from"] == "gpt").split()


def test_the_data_docs_examples_parse():
    text = (Path(__file__).parents[2] / "docs" / "data.md").read_text()
    examples = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", text, re.DOTALL)]
    segments = [e for e in examples if "segments" in e]
    assert len(segments) == 1 and record_fields(segments[0])[1] == "image"
    llava, share, oai, sized = (parse_conversation(e) for e in examples if "segments" not in e)
    assert llava.messages == share.messages == oai.messages and llava.media == share.media == oai.media
    assert sized.media[0].sizes == {"width": 640, "height": 480} and sized.messages[0]["role"] == "system"


def test_the_profile_and_the_loader_read_conversations(tmp_path):
    write_llava(tmp_path, 12)
    good = json.loads((tmp_path / "llava.json").read_text())
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*BAD.values(), *good]))
    cfg = DataConfig(source="jsonl", seq_len=256, heldout_fraction=0.01)
    dataset = ManifestDataset(tmp_path / "mixed.jsonl", cfg)
    dataset.source.render = byte_chatml
    flops = FlopModel.for_flavor("debug", patch_size=cfg.patch_size, n_mels=cfg.n_mels)
    columns = profile_source(dataset, cfg, 0, flops)
    assert columns.total_samples == 12 and columns.skipped == dict.fromkeys(BAD, 1)
    assert columns.model_dump_json() == profile_source(dataset, cfg, 0, flops, by_record=True).model_dump_json()
    batch = next(iter(PackedLoader(dataset, cfg, "train")))
    targets = batch.labels[batch.labels != IGNORE].tolist()
    replies = {t["value"] + "\n" for r in good for t in r["conversations"] if t["from"] == "gpt"}
    trained = BYTES.decode(targets).splitlines(keepends=True)
    assert trained and set(trained) <= replies and targets.count(EOS_ID) == 0  # byte_chatml writes no EOS


def test_media_paths_are_relative_to_the_media_root(tmp_path):
    write_llava(tmp_path / "media", 3)
    (tmp_path / "manifests").mkdir()
    (tmp_path / "manifests" / "x.json").write_text((tmp_path / "media" / "llava.json").read_text())
    missing, skips, _ = read(tmp_path / "manifests" / "x.json")
    assert not missing and skips == Counter(missing_file=3)
    got, skips, src = read(tmp_path / "manifests" / "x.json", media_root=str(tmp_path / "media"))
    assert len(got) == 3 and not skips
    segment = src.sample(got[0]).segments[0]
    assert src.media(got[0], segment).size == (segment.width, segment.height) == (24, 16)


def collapsed(ids: list[int], placeholder: int) -> list[int]:
    """`ids` with each run of the placeholder as one: how a chat template writes an image."""
    return [i for k, (i, _) in enumerate(zip(ids, [None, *ids])) if not (i == placeholder == ids[k - 1] and k)]


@pytest.mark.parametrize(("style", "eos_token"), [("chatml", None), ("llama", None), ("chatml", "<|endoftext|>")])
def test_a_conversation_document_is_its_templates_rendering(llava, tmp_path, style, eos_token):
    """The ids a conversation trains on are transformers' apply_chat_template ids (an image's placeholder
    repeated per patch), BOS as the template writes it; under a tokenizer whose EOS the template never writes (a
    base model's `<|endoftext|>`) one EOS closes the document, and is trained."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    folder = write_tokenizer(tmp_path / "tok", style)
    if eos_token:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": eos_token}))
    tokenizer = HFTokenizer.from_pretrained(folder)
    reference = AutoTokenizer.from_pretrained(folder)
    added = sorted(tokenizer.placeholder_ids.values())
    reference.add_tokens([AddedToken(tokenizer.backend.id_to_token(i), special=True, normalized=False) for i in added])
    dataset = ManifestDataset(llava["json"], DataConfig(source="jsonl", seq_len=1024), tokenizer)
    by_id = {r["id"]: r for r in json.loads(llava["json"].read_text())}
    image = tokenizer.placeholder_ids["image"]
    for record in helper_records(dataset)[:3]:
        doc = dataset.decode(record)
        assert doc.trainable is not None and len(doc.input_ids) == record.tokens
        expected = list(reference.apply_chat_template(parse_conversation(by_id[record.id]).messages)["input_ids"])
        appended = [tokenizer.eos_id] if eos_token else []
        assert collapsed(doc.input_ids, image) == expected + appended
        assert doc.input_ids.count(image) == record.image_llm > 0
        runs = [[i for i, _ in run] for t, run in groupby(zip(doc.input_ids, doc.trainable), key=lambda p: p[1]) if t]
        assert tokenizer.eos_id in runs[-1][-2:]  # the last reply ends trained on EOS: the model learns to stop


@pytest.mark.parametrize("style", ["chatml", "llama"])
def test_a_pretrained_tokenizers_batch_trains_only_on_the_replies(llava, tmp_path, style):
    """Through the loader with the LLM's tokenizer: the targets, decoded, are exactly the replies (each with the
    end-of-turn tokens its template writes); the images' placeholders are in place."""
    tokenizer = HFTokenizer.from_pretrained(write_tokenizer(tmp_path / "tok", style))
    cfg = DataConfig(source="jsonl", seq_len=1024, heldout_fraction=0.01)
    dataset = ManifestDataset(llava["json"], cfg, tokenizer)
    batch = next(iter(PackedLoader(dataset, cfg, "train")))
    image = tokenizer.placeholder_ids["image"]
    assert (batch.input_ids == image).sum() == batch.image_patches.shape[0] > 0
    bounds = batch.cu_seqlens.tolist()
    records = json.loads(llava["json"].read_text())
    replies = {t["value"] for r in records for t in r["conversations"] if t["from"] == "gpt"}
    for a, b in pairwise(bounds[: batch.num_samples + 1]):  # one sequence: its samples come first
        labels, ids = batch.labels[a:b].tolist(), batch.input_ids[a:b].tolist()
        assert tokenizer.eos_id in [t for t in labels if t != IGNORE][-2:]  # its end of turn, or "\n" after it
        assert ids.count(tokenizer.bos_id) == (tokenizer.bos_id is not None) == (ids[0] == tokenizer.bos_id)
        runs = [list(run) for target, run in groupby(labels, key=lambda t: t != IGNORE) if target]
        said = [tokenizer.decode(run, skip_special_tokens=True).strip() for run in runs]
        assert len(said) == 2 and set(said) <= replies, said


def test_data_format_reads_every_record_as_it_says(llava, tmp_path):
    with pytest.raises(NoRenderer, match=r"data\.format is conversation"):
        open_source(str(llava["jsonl"]), DataConfig(source="jsonl", format="conversation"))
    segment = {"id": "s", "segments": [{"type": "text", "text": "plain text."}]}
    conversation = json.loads(llava["jsonl"].read_text().splitlines()[0])
    (tmp_path / "both.jsonl").write_text(f"{json.dumps(segment)}\n{json.dumps(conversation)}\n")
    for fmt, kept in (("auto", ["s", "conv-0000"]), ("segments", ["s"]), ("conversation", ["conv-0000"])):
        got, skips, _ = read(tmp_path / "both.jsonl", format=fmt, media_root=str(llava["jsonl"].parent))
        assert [r.id for r in got] == kept and sum(skips.values()) == 2 - len(kept), fmt
        assert set(skips) <= {"bad_record"}


def test_the_launch_check_reads_conversations_with_the_llms_tokenizer(llava, tmp_path):
    from omni_core.runtime.preflight import _check_usable

    folder = write_tokenizer(tmp_path / "tok", "chatml")
    path = str(llava["json"])
    with_llm = build_recipe(tmp_path, {"data.source": "jsonl", "data.path": path, "model.pretrained.llm": str(folder)})
    _check_usable(path, with_llm)  # meets a usable conversation
    with pytest.raises(NoRenderer, match="chat template"):
        _check_usable(path, build_recipe(tmp_path, {"data.source": "jsonl", "data.path": path}))


def test_a_shards_members_are_the_media_its_records_leave_unlisted(tmp_path):
    wave = io.BytesIO()
    sf.write(wave, np.zeros(8000), 16000, format="FLAC")
    samples = {
        "a": {
            "flac": wave.getvalue(),
            "json": {
                "messages": [
                    {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is it?"}]},
                    {"role": "assistant", "content": "Silence."},
                ]
            },
        },
        "b": {
            "png": png("red", (16, 16)),
            "json": {
                "conversations": [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Red."}]
            },
        },
        "c": {
            "png": png("red", (16, 16)),
            "json": {"conversations": [{"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "Two?"}]},
        },
    }
    with tarfile.open(tmp_path / "s-0.tar", "w") as tar:
        for key, members in samples.items():
            for ext, data in members.items():
                body = json.dumps(data).encode() if ext == "json" else data
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    got, skips, _ = read(tmp_path / "s-0.tar", "wds")
    summary = [(r.id, r.modality, r.audio_items, r.image_items) for r in got]
    assert summary == [("a", "audio", 1, 0), ("b", "image", 0, 1)]
    assert skips == Counter(media_marker_mismatch=1)  # c: two markers, one image


@pytest.mark.parametrize(
    ("part", "reason"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "unsafe_path"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}, "unsafe_path"),
        ({"type": "image_url", "image_url": {}}, "bad_record"),
        ({"type": "image", "image": "/etc/passwd"}, "unsafe_path"),
        ({"type": "image"}, "media_marker_mismatch"),
        ({"type": "tool_call"}, "bad_record"),
        ({"type": "image", "image": "a.png", "width": 4}, "bad_record"),  # sizes: all or none
    ],
)
def test_typed_parts_that_cannot_be_read_are_refused_by_reason(part, reason):
    record = {"messages": [{"role": "user", "content": [part]}, {"role": "assistant", "content": "ok"}]}
    with pytest.raises(CorruptSample, match=reason):
        parse_conversation(record)
    ok = parse_conversation(
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x/a.png"}}]},
                {"role": "assistant", "content": "ok"},
            ]
        }
    )
    assert ok.media[0].path == "x/a.png" and ok.id.startswith("sha1-")


def test_an_image_is_sized_from_its_first_bytes_or_else_whole(tmp_path):
    from PIL import Image

    big_icc = tmp_path / "late.jpg"  # a 150 kB ICC profile before the frame header
    Image.new("RGB", (40, 24), (1, 2, 3)).save(big_icc, "JPEG", icc_profile=b"\0" * 150_000)
    (tmp_path / "early.png").write_bytes(png("red", (16, 32)))
    turns = [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]
    records = [{"id": name, "image": name, "conversations": turns} for name in ("late.jpg", "early.png")]
    (tmp_path / "m.json").write_text(json.dumps(records))
    reads: Counter[str] = Counter()
    source = JsonlSource(str(tmp_path / "m.json"), DataConfig(source="jsonl"))
    source.render = byte_chatml
    read_file = source.storage.read
    source.storage.read = lambda location: reads.update([Path(location).name]) or read_file(location)
    stream = source.stream(View(0, 1, "all", 0, one_pass=True, shuffle=False), None, print)
    got = list(iter(lambda: stream.next(0), None))
    assert [source.sample(r).segments[0].width for r in got] == [40, 16]
    assert reads == Counter({"late.jpg": 1})  # the PNG's first bytes were enough (the manifest is mapped)
