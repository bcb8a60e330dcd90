"""Sources: WebDataset shards (with and without metadata members), sharding over consumers and epochs,
and bad data that is skipped and counted, never fatal."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from omni_core.common.tokenizer import AUDIO_ID, VIDEO_ID
from omni_core.data.dataset import ManifestDataset, open_dataset
from omni_core.data.flops import FlopModel
from omni_core.data.loader import ConsumerStream, PackedLoader
from omni_core.data.profile import profile_dataset, profile_source
from omni_core.data.source_base import View, in_heldout
from omni_core.recipe.data_sections import DataConfig
from tests.helpers.data_sources import MIX, SOURCES, both_formats, records, same_docs
from tests.helpers.recipes import build_recipe


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> tuple[ManifestDataset, ManifestDataset]:
    """The same generated samples as a JSONL manifest and as WebDataset shards."""
    return both_formats(tmp_path_factory.mktemp("both"))


def test_webdataset_round_trip_equals_the_jsonl_manifest(both):
    jsonl, wds = both
    assert len(wds.source.shards) == 6  # 40 samples, 7 per shard
    a, b = records(jsonl), records(wds)
    assert [(r.id, r.modality, r.tokens, r.segment_tokens) for r in a] == \
           [(r.id, r.modality, r.tokens, r.segment_tokens) for r in b]
    assert {r.modality for r in a} == set(MIX)
    for x, y in zip(a, b):
        assert same_docs(jsonl.decode(x), wds.decode(y)), x.id
    video = next(r for r in b if r.modality == "video")
    doc = wds.decode(video)
    frames = min(8, wds.source.sample(video).segments[0].num_frames)
    assert [grid[0] for grid in doc.video_grids] == [frames] and not doc.image_grids
    assert doc.modality == "video" and doc.input_ids.count(VIDEO_ID) == video.video_llm
    assert len(doc.video_patches[0]) == video.video_patches == video.vision_tokens


def test_webdataset_without_metadata_members_is_sized_from_headers(tmp_path):
    members = {}
    for name, size in [("a", (30, 20)), ("b", (8, 40))]:
        out = io.BytesIO()
        Image.new("RGB", size, (10, 200, 10)).save(out, "JPEG" if name == "a" else "PNG")
        members[f"{name}.{'jpg' if name == 'a' else 'png'}"] = out.getvalue()
        members[f"{name}.txt"] = f"caption {name}".encode()
    out = io.BytesIO()
    sf.write(out, np.zeros(8000), 16000, format="FLAC")
    members["c.flac"] = out.getvalue()
    out = io.BytesIO()
    frames = [Image.new("RGB", (24, 16), (k * 60, 0, 0)) for k in range(3)]
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=1000)
    members["d.gif"], members["e.txt"] = out.getvalue(), b"just text"
    with tarfile.open(tmp_path / "shard.tar", "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cfg = DataConfig(source="wds")
    dataset = ManifestDataset(tmp_path / "shard.tar", cfg)
    got = {r.id: r for r in records(dataset)}
    assert {k: r.modality for k, r in got.items()} == {"a": "image", "b": "image", "c": "audio", "d": "video",
                                                       "e": "text"}
    assert [(s.kind, s.width, s.height) for s in dataset.source.sample(got["a"]).segments] == [("image", 30, 20),
                                                                                               ("text", 0, 0)]
    assert dataset.source.sample(got["a"]).segments[1].text == "caption a"
    assert got["b"].vision_tokens == 5 and got["d"].vision_tokens == 3 * 6  # 1x5 patches; 3 frames of 2x3
    assert got["c"].tokens == 2 + 25 and got["e"].tokens == 2 + len("just text")
    docs = {k: dataset.decode(r) for k, r in got.items()}
    assert docs["c"].input_ids.count(AUDIO_ID) == 25 and docs["c"].audio_mels[0].shape == (50, cfg.n_mels)
    assert docs["d"].video_grids == [(3, 2, 3)] and docs["d"].video_patches[0].shape == (18, 3 * 8 * 8)
    assert docs["d"].input_ids.count(VIDEO_ID) == got["d"].tokens - 2 == 2 * 2 * 3  # 3 frames merge into 2


def test_webdataset_shards_are_dealt_to_consumers_and_reshuffled_per_epoch(both):
    _, wds = both
    all_ids = [r.id for r in records(wds, "train")]
    for epoch in (0, 1):
        shares = [[r.id for r in records(wds, "train", c, 4, epoch_seed=epoch)] for c in range(4)]
        assert sorted(sum(shares, [])) == sorted(all_ids)  # disjoint and covering: whole shards each
    plans = [wds.source.plan(View(0, 4, "train", 0, one_pass=False, shuffle=True), e)[0] for e in range(4)]
    assert all(len(p) in (1, 2) for p in plans) and len({tuple(p) for p in plans}) > 1


def test_webdataset_loader_resumes_mid_shard(tmp_path):
    recipe = build_recipe(tmp_path, {**SOURCES, "data.synthetic.num_samples": 60, "data.micro_batch": 1,
                                     "data.seq_len": 256})
    dataset = open_dataset(recipe)
    reference = PackedLoader(dataset, recipe.data, "train", 0, 1, 3)
    stream = iter(reference)
    [next(stream) for _ in range(4)]
    state = json.loads(json.dumps(reference.state_dict()))
    assert state["consumers"][0]["position"][2] > 0  # a byte offset inside a shard
    expected = [next(stream) for _ in range(12)]
    resumed = PackedLoader(dataset, recipe.data, "train", 0, 1, 3)
    resumed.load_state_dict(state)
    for a, b in zip(expected, [x for _, x in zip(range(12), resumed)]):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.image_patches, b.image_patches)


def member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, "PNG")
    return out.getvalue()


def image_sample(tar: tarfile.TarFile, key: str, width: int, height: int, data: bytes | None) -> None:
    meta = {"segments": [{"type": "image", "path": "png", "width": width, "height": height},
                         {"type": "text", "path": "txt"}]}
    member(tar, f"{key}.json", json.dumps(meta).encode())
    if data is not None:
        member(tar, f"{key}.png", data)
    member(tar, f"{key}.txt", b"a red square on white.")


def test_bad_members_and_shards_are_skipped_and_counted_never_fatal(tmp_path):
    with tarfile.open(tmp_path / "shard-0.tar", "w") as tar:
        image_sample(tar, "good-1", 16, 16, png(16, 16))
        image_sample(tar, "corrupt", 16, 16, b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
        image_sample(tar, "missing", 16, 16, None)
        image_sample(tar, "oversized", 20000, 20000, png(16, 16))
        meta = {"segments": [{"type": "audio", "path": "wav", "num_samples": 1600, "sample_rate": 16000},
                             {"type": "text", "text": "do."}]}
        member(tar, "empty.json", json.dumps(meta).encode())
        member(tar, "empty.wav", b"")
        image_sample(tar, "good-2", 24, 8, png(24, 8))
    with tarfile.open(tmp_path / "shard-1.tar", "w") as tar:
        image_sample(tar, "good-3", 16, 16, png(16, 16))
        image_sample(tar, "lost", 40, 40, png(40, 40))
    whole = (tmp_path / "shard-1.tar").read_bytes()
    (tmp_path / "shard-1.tar").write_bytes(whole[: len(whole) // 2 + 700])  # cut inside lost.png
    recipe = build_recipe(tmp_path / "out", {"experiment.name": "bad", "data.source": "wds", "data.path": tmp_path,
                                             "data.seq_len": 512, "data.heldout_fraction": 0.01,
                                             "data.profile_decode": True, "data.profile_window": 10})
    cfg = recipe.data

    profile, _ = profile_dataset(recipe, tmp_path / "profile")
    assert profile.total_samples == 3 and profile.modalities["image"].count == 3
    assert profile.skipped == {"unreadable_file": 1, "missing_file": 1, "oversized_image": 1, "empty_audio": 1,
                               "truncated_shard": 1}
    assert profile.manifest_samples == 8

    dataset = ManifestDataset(tmp_path, cfg)
    flops = FlopModel.for_flavor("debug", patch_size=cfg.patch_size, n_mels=cfg.n_mels)
    metadata = profile_source(dataset, cfg, 0, flops)  # as columns; nothing decoded, so only what metadata shows
    assert metadata.model_dump_json() == profile_source(dataset, cfg, 0, flops, by_record=True).model_dump_json()
    assert metadata.skipped == {"missing_file": 1, "oversized_image": 1, "truncated_shard": 1}
    assert metadata.total_samples == 5 and metadata.manifest_samples == 8

    stream = ConsumerStream(dataset, cfg, View(0, 1, "train", 0, one_pass=True, shuffle=False), lambda b: b)
    batches = list(iter(stream.next_batch, None))
    assert sum(b.num_samples for b in batches) == 3
    decode_failures = {"corrupt": "unreadable_file", "empty": "empty_audio"}
    expected = {"missing_file": 1, "oversized_image": 1, "truncated_shard": 1}
    for key, reason in decode_failures.items():
        if not in_heldout(key, cfg.heldout_fraction):
            expected[reason] = 1
    assert stream.stats == expected


def truncated_shards(folder, index: dict | None) -> None:
    """shard-0: 3 whole samples; shard-1: 5 samples, cut inside the third (2 whole ones come out)."""
    folder.mkdir()
    with tarfile.open(folder / "shard-0.tar", "w") as tar:
        for i in range(3):
            image_sample(tar, f"a{i}", 16, 16, png(16, 16))
    with tarfile.open(folder / "shard-1.tar", "w") as tar:
        for i in range(5):
            image_sample(tar, f"b{i}", 16 + i, 16, png(16 + i, 16))
    whole = (folder / "shard-1.tar").read_bytes()
    with tarfile.open(folder / "shard-1.tar") as tar:
        third = next(m for m in tar.getmembers() if m.name == "b2.png")
    (folder / "shard-1.tar").write_bytes(whole[: third.offset_data + 10])
    if index is not None:
        (folder / "shardindex.json").write_text(json.dumps(index))


@pytest.mark.parametrize("with_index", [True, False])
def test_a_truncated_shards_lost_samples_are_counted_where_an_index_says_how_many(tmp_path, with_index):
    index = {"wids_version": 1, "shardlist": [{"url": "shard-0.tar", "nsamples": 3},
                                              {"url": "shard-1.tar", "nsamples": 5}]}
    truncated_shards(tmp_path / "wds", index if with_index else None)
    cfg = DataConfig(source="wds", path=str(tmp_path / "wds"))
    stream = ConsumerStream(ManifestDataset(tmp_path / "wds", cfg), cfg,
                            View(0, 1, "all", 0, one_pass=True, shuffle=False), lambda b: b)
    assert sum(b.num_samples for b in iter(stream.next_batch, None)) == 5  # 3 + the 2 before the cut
    assert stream.stats == ({"truncated_shard": 1, "lost_sample": 3} if with_index else {"truncated_shard": 1})


def test_a_malformed_shard_index_is_refused_by_file_and_field(tmp_path):
    truncated_shards(tmp_path / "wds", {"shardlist": [{"url": "shard-0.tar", "nsamples": -1}]})
    cfg = DataConfig(source="wds", path=str(tmp_path / "wds"))
    with pytest.raises(ValueError, match=r"shardindex\.json: shardlist\[0\] needs .* 'nsamples'"):
        ManifestDataset(tmp_path / "wds", cfg)
