"""Data v0: synthetic generation, manifest dataset, decoding, packing, loader (sharding, resume, corruption)
and profiling. Expected values are computed here independently (by hand or from raw files), not by calling
the code under test again."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from omni_core.data.audio import log_mel, mel_frames
from omni_core.data.batch import MODALITY_IDS, PackedBatch, audio_tokens
from omni_core.data.dataset import MANIFEST, CorruptSample, DecodedSample, ManifestDataset, in_heldout
from omni_core.data.image import patch_grid, patchify
from omni_core.data.loader import PackedLoader
from omni_core.data.packing import collate, pack_sequences
from omni_core.data.profile import DatasetProfile, profile_dataset
from omni_core.data.sample import token_ids
from omni_core.data.synthetic import BACKGROUNDS, COLORS, TONES, ensure_dataset, generate_dataset
from omni_core.data.tokenizer import AUDIO_ID, BOS_ID, EOS_ID, IMAGE_ID, PAD_ID
from omni_core.recipe.schema import DataConfig, Recipe

N = 60
LOADER_CFG = DataConfig(seq_len=128, micro_batch=2, heldout_fraction=0.2)


def make_recipe(tmp_path: Path, num_samples: int = N, **data) -> Recipe:
    return Recipe(
        experiment={"name": "t", "seed": 3, "output_dir": str(tmp_path)},
        data={"synthetic": {"num_samples": num_samples}, **data},
    )


def read_manifest(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    """One shared generated dataset; tests that damage files work on a copy."""
    return ensure_dataset(make_recipe(tmp_path_factory.mktemp("shared")))


def loader(manifest: Path, cfg: DataConfig = LOADER_CFG, **kwargs) -> PackedLoader:
    return PackedLoader(ManifestDataset(manifest, cfg), cfg, **kwargs)


def take(iterator, n: int) -> list[PackedBatch]:
    return [next(iterator) for _ in range(n)]


def documents(batch: PackedBatch) -> list[torch.Tensor]:
    cu = batch.cu_seqlens.tolist()
    return [batch.input_ids[a:b] for a, b in zip(cu, cu[1:])]


# --- generation ------------------------------------------------------------------------------------------


def test_generator_is_deterministic_with_exact_mix(tmp_path):
    recipe = make_recipe(tmp_path)
    a, b = generate_dataset(recipe, tmp_path / "a").parent, generate_dataset(recipe, tmp_path / "b").parent
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert len(files) > N // 2
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    assert Counter(s["modality"] for s in read_manifest(a / MANIFEST)) == {"text": 24, "image": 24, "audio": 12}
    other_seed = recipe.model_copy(update={"experiment": recipe.experiment.model_copy(update={"seed": 4})})
    assert generate_dataset(other_seed, tmp_path / "c").read_bytes() != (a / MANIFEST).read_bytes()


def test_crashed_generation_leaves_nothing_that_looks_complete(tmp_path):
    recipe = make_recipe(tmp_path)
    out = Path(recipe.data_dir())

    def crash(done: int, total: int) -> None:
        if done == 10:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_dataset(recipe, out, progress=crash)
    assert not out.exists() and list(out.parent.iterdir()) == []
    assert ensure_dataset(recipe) == out / MANIFEST and len(read_manifest(out / MANIFEST)) == N


def test_ensure_dataset_regenerates_only_its_own_stale_data(tmp_path):
    manifest = ensure_dataset(make_recipe(tmp_path, num_samples=20))
    assert len(read_manifest(manifest)) == 20
    assert len(read_manifest(ensure_dataset(make_recipe(tmp_path, num_samples=30)))) == 30  # settings changed
    (manifest.parent / "synthetic.json").unlink()  # now it looks like someone's real data: never overwrite
    assert len(read_manifest(ensure_dataset(make_recipe(tmp_path, num_samples=40)))) == 30


def test_captions_describe_the_drawn_shape_and_colors(manifest):
    names = {rgb: name for name, rgb in {**COLORS, **BACKGROUNDS}.items()}
    fill_ratio = {"square": 1.0, "circle": math.pi / 4, "triangle": 0.5}
    images = [s for s in read_manifest(manifest) if s["modality"] == "image"]
    for sample in images:
        seg, caption = sample["segments"][0], sample["segments"][1]["text"]
        pixels = np.asarray(Image.open(manifest.parent / seg["path"]).convert("RGB"))
        assert pixels.shape == (seg["height"], seg["width"], 3)
        border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
        background = Counter(map(tuple, border.tolist())).most_common(1)[0][0]
        colors = set(map(tuple, pixels.reshape(-1, 3).tolist()))
        assert len(colors) == 2, caption  # one flat shape on a flat background
        (shape_rgb,) = colors - {background}
        ys, xs = np.nonzero((pixels == shape_rgb).all(axis=2))
        ratio = len(ys) / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
        shape = min(fill_ratio, key=lambda s: abs(fill_ratio[s] - ratio))
        assert caption == f"a {names[shape_rgb]} {shape} on {names[background]}."


def test_transcripts_name_the_tones_in_order(manifest):
    for sample in (s for s in read_manifest(manifest) if s["modality"] == "audio"):
        seg, words = sample["segments"][0], sample["segments"][1]["text"].rstrip(".").split()
        wave, rate = sf.read(manifest.parent / seg["path"])
        assert (len(wave), rate) == (seg["num_samples"], seg["sample_rate"])
        bounds = [len(wave) * k // len(words) for k in range(len(words) + 1)]
        for word, a, b in zip(words, bounds, bounds[1:]):
            spectrum = np.abs(np.fft.rfft(wave[a:b], n=8 * rate // 10))  # 1.25 Hz bins
            assert abs(np.argmax(spectrum) * 1.25 - TONES[word]) < 20, (sample["id"], word)


# --- token rules and decoding ----------------------------------------------------------------------------


def test_patch_grid_keeps_aspect_under_budget():
    assert patch_grid(17, 9, 8, 64) == (2, 3)
    assert patch_grid(64, 64, 8, 64) == (8, 8)
    for width, height in [(800, 600), (1000, 10), (3, 5000), (65, 64)]:
        rows, cols = patch_grid(width, height, 8, 64)
        assert 1 <= rows * cols <= 64
        assert rows * cols >= 40 or min(rows, cols) == 1  # no needless shrinking
    assert patch_grid(800, 600, 8, 64) == (6, 9)


def test_patchify_is_row_major_channel_first():
    pixels = np.arange(2 * 4 * 3, dtype=np.uint8).reshape(2, 4, 3) * 10  # h=2, w=4
    patches, grid = patchify(Image.fromarray(pixels), patch_size=2, max_patches=8)
    assert grid == (1, 2) and patches.shape == (2, 12)
    expected = torch.from_numpy(pixels[:, 2:4, :].astype(np.float32)).permute(2, 0, 1).reshape(-1) / 127.5 - 1
    assert torch.allclose(patches[1], expected)


@pytest.mark.parametrize("num_samples", [1, 159, 160, 479, 480, 640, 11376])
def test_log_mel_frames_follow_the_token_rule(num_samples):
    by_hand = max(4, (1 + num_samples // 160) // 4 * 4)  # 10 ms hop at 16 kHz, centred
    mels = log_mel(torch.randn(num_samples), 16000, 32)
    assert mels.shape == (by_hand, 32) == (mel_frames(num_samples, 16000), 32)


def test_log_mel_puts_pitch_in_the_right_band():
    t = torch.arange(8000) / 16000
    peaks = [log_mel(torch.sin(2 * math.pi * f * t), 16000, 32).mean(0).argmax().item() for f in TONES.values()]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)


def test_jsonl_source_with_foreign_formats(tmp_path):
    """JPEG over the patch budget, stereo WAV at another rate, a text-only line: counts match decodes."""
    (tmp_path / "m").mkdir()
    Image.new("RGB", (200, 50), (200, 10, 10)).save(tmp_path / "m/wide.jpg")
    sf.write(tmp_path / "m/stereo.wav", np.zeros((4000, 2)), 8000, subtype="PCM_16")
    lines = [
        {"id": "a", "segments": [
            {"type": "text", "text": "see "}, {"type": "image", "path": "wide.jpg", "width": 200, "height": 50}]},
        {"id": "b", "segments": [{"type": "audio", "path": "stereo.wav", "num_samples": 4000, "sample_rate": 8000}]},
        {"id": "c", "modality": "text", "segments": [{"type": "text", "text": "héllo"}]},
    ]
    (tmp_path / "m" / MANIFEST).write_text("".join(json.dumps(line) + "\n" for line in lines))
    recipe = make_recipe(tmp_path, source="jsonl", path=str(tmp_path / "m"))
    dataset = ManifestDataset(ensure_dataset(recipe), recipe.data)
    image, audio, text = (dataset.decode(i) for i in range(3))
    assert image.image_grids == [(4, 16)] and image.image_patches[0].shape == (64, 192)
    assert image.input_ids == [BOS_ID, *b"see ", *[IMAGE_ID] * 64, EOS_ID] and image.modality == "image"
    assert audio.audio_mels[0].shape == (48, 32)  # 0.5 s resampled to 16 kHz: 1 + 8000 // 160 = 51 -> 48
    assert audio.input_ids == [BOS_ID, *[AUDIO_ID] * 12, EOS_ID]
    assert text.input_ids == [BOS_ID, *"héllo".encode(), EOS_ID] and dataset.token_count(2) == 8


# --- packing and the loader ------------------------------------------------------------------------------


def test_collate_labels_positions_and_boundaries_by_hand():
    cfg = DataConfig(seq_len=16, micro_batch=2, patch_size=2, n_mels=4)
    text = DecodedSample([BOS_ID, 104, 105, EOS_ID])
    image = DecodedSample([BOS_ID, IMAGE_ID, IMAGE_ID, 97, EOS_ID], "image", [torch.ones(2, 12)], [(1, 2)])
    audio = DecodedSample([BOS_ID, AUDIO_ID, 120, EOS_ID], "audio", audio_mels=[torch.zeros(4, 4)])
    long_text = DecodedSample([BOS_ID, *range(65, 75), EOS_ID])  # 12 tokens: fills sequence 2 exactly
    batch = collate([[text, image], [audio, long_text]], cfg)
    X = -100
    assert batch.input_ids.tolist() == (
        [BOS_ID, 104, 105, EOS_ID] + [BOS_ID, IMAGE_ID, IMAGE_ID, 97, EOS_ID] + [PAD_ID] * 7
        + [BOS_ID, AUDIO_ID, 120, EOS_ID] + [BOS_ID, *range(65, 75), EOS_ID]
    )
    assert batch.labels.tolist() == (
        [104, 105, EOS_ID, X] + [X, X, 97, EOS_ID, X] + [X] * 7
        + [X, 120, EOS_ID, X] + [*range(65, 75), EOS_ID, X]
    )
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, *range(7), 0, 1, 2, 3, *range(12)]
    assert batch.cu_seqlens.tolist() == [0, 4, 9, 16, 20, 32] and batch.cu_seqlens.dtype == torch.int32
    assert batch.loss_modality.tolist() == [0] * 4 + [1] * 5 + [0] * 7 + [2] * 4 + [0] * 12
    assert batch.image_grids.tolist() == [[1, 2]] and batch.image_patches.shape == (2, 12)
    assert batch.audio_frames.tolist() == [4] and batch.audio_mels.shape == (4, 4)
    assert batch.num_samples == 4 and batch.num_loss_tokens == 18
    with pytest.raises(ValueError, match="seq_len"):
        collate([[long_text, long_text]], cfg)


@pytest.mark.parametrize("low,high", [(5, 60), (1, 2)])  # (1, 2): a whole window fits one bin
def test_pack_sequences_places_every_item_once_and_densely(low, high):
    sizes = np.random.default_rng(0).integers(low, high, size=1000).tolist()
    sequences = pack_sequences(enumerate(sizes), seq_len=128)
    assert sorted(i for seq in sequences for i in seq) == list(range(1000))
    loads = [sum(sizes[i] for i in seq) for seq in sequences]
    assert max(loads) <= 128 and sum(sizes) / (128 * len(sequences)) > 0.97
    assert sequences == pack_sequences(enumerate(sizes), seq_len=128)


def check_batch(batch: PackedBatch, cfg: DataConfig) -> list[tuple[int, ...]]:
    """Asserts the PackedBatch contract on a real batch; returns its real documents' input ids."""
    ids, cu = batch.input_ids, batch.cu_seqlens.tolist()
    assert len(ids) == cfg.micro_batch * cfg.seq_len and cu[0] == 0 and cu[-1] == len(ids)
    assert all(k * cfg.seq_len in cu for k in range(cfg.micro_batch))  # no document crosses sequences
    real = []
    for (a, b), doc in zip(zip(cu, cu[1:]), documents(batch)):
        assert batch.position_ids[a:b].tolist() == list(range(b - a))
        if doc[0] == PAD_ID:
            assert (doc == PAD_ID).all() and (batch.labels[a:b] == -100).all()
            continue
        assert doc[0] == BOS_ID and doc[-1] == EOS_ID and ((doc == BOS_ID) | (doc == EOS_ID)).sum() == 2
        expected = [int(n) if n < 256 or n == EOS_ID else -100 for n in doc[1:]] + [-100]
        assert batch.labels[a:b].tolist() == expected
        modality = "image" if IMAGE_ID in doc else "audio" if AUDIO_ID in doc else "text"
        assert (batch.loss_modality[a:b] == MODALITY_IDS[modality]).all()
        real.append(tuple(doc.tolist()))
    assert batch.num_samples == len(real)
    grids = batch.image_grids
    assert (ids == IMAGE_ID).sum() == len(batch.image_patches) == int((grids[:, 0] * grids[:, 1]).sum())
    frames = batch.audio_frames.tolist()
    assert (ids == AUDIO_ID).sum() == sum(audio_tokens(f) for f in frames)
    assert len(batch.audio_mels) == sum(frames) and all(f % 4 == 0 for f in frames)
    return real


def test_one_epoch_holds_every_train_sample_exactly_once_and_whole(manifest):
    train = loader(manifest)
    dataset = train.dataset
    batches = take(iter(train), len(train.plan(0)))
    seen = Counter(doc for batch in batches for doc in check_batch(batch, LOADER_CFG))
    expected = Counter(tuple(token_ids(dataset.samples[i], LOADER_CFG)) for i in dataset.splits["train"])
    assert seen == expected and sum(expected.values()) == len(dataset.splits["train"])
    first_half = [doc for batch in batches[: len(batches) // 2] for doc in check_batch(batch, LOADER_CFG)]
    assert {IMAGE_ID, AUDIO_ID} <= {t for doc in first_half for t in doc}  # not sorted by length (= modality)


def test_split_is_stable_and_too_long_samples_are_counted(manifest, tmp_path):
    cfg = LOADER_CFG.model_copy(update={"seq_len": 40})
    dataset = ManifestDataset(manifest, cfg)
    reordered = tmp_path / MANIFEST
    reordered.write_text("".join(reversed(manifest.read_text().splitlines(keepends=True))))

    def heldout_ids(ds: ManifestDataset) -> set[str]:
        return {ds.samples[i].id for i in ds.splits["heldout"]}

    assert heldout_ids(ManifestDataset(reordered, cfg)) == heldout_ids(dataset)
    assert 0 < len(heldout_ids(dataset)) < N // 2
    too_long = sum(dataset.token_count(i) > 40 for i in dataset.splits["train"])
    train = PackedLoader(dataset, cfg)
    assert too_long > 0 and train.stats == {"too_long": too_long}
    docs = [doc for batch in take(iter(train), len(train.plan(0))) for doc in check_batch(batch, cfg)]
    assert len(docs) == len(dataset.splits["train"]) - too_long


def test_rank_shards_are_disjoint_covering_and_equally_long(manifest):
    ranks = [loader(manifest, rank=r, world_size=3) for r in range(3)]
    eligible = set(ranks[0].dataset.splits["train"])
    for epoch in (0, 1):
        shards = [{i for batch in r.plan(epoch) for seq in batch for i in seq} for r in ranks]
        assert set().union(*shards) == eligible and sum(map(len, shards)) == len(eligible)
        assert len({len(r.plan(epoch)) for r in ranks}) == 1
    assert ranks[0].plan(0) != ranks[0].plan(1)  # reshuffled per epoch
    heldout = [loader(manifest, split="heldout", rank=r, world_size=3) for r in range(3)]
    passes = [len(list(h)) for h in heldout] + [len(list(h)) for h in heldout]  # each iter() is a full pass
    assert len(set(passes)) == 1 and passes[0] >= 1


def test_resumed_loader_yields_exactly_the_remaining_batches(manifest):
    reference = loader(manifest, rank=1, world_size=2, seed=7)
    per_epoch = len(reference.plan(0))
    stream = iter(reference)
    take(stream, per_epoch - 2)
    state = json.loads(json.dumps(reference.state_dict()))  # as a checkpoint would store it
    expected = take(stream, 5)  # crosses into epoch 1
    resumed = loader(manifest, rank=1, world_size=2, seed=7)
    resumed.load_state_dict(state)
    got = take(iter(resumed), 5)
    for a, b in zip(expected, got):
        for name, value in vars(a).items():
            other = getattr(b, name)
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, name
    fresh_epoch = take(iter(loader(manifest, rank=1, world_size=2, seed=7)), 1)[0]
    assert not torch.equal(fresh_epoch.input_ids, got[-1].input_ids)  # the comparison can tell batches apart
    with pytest.raises(ValueError, match="world_size"):
        loader(manifest, world_size=3, seed=7).load_state_dict(state)


def test_corrupt_truncated_and_missing_files_are_skipped_and_counted(manifest, tmp_path):
    root = Path(shutil.copytree(manifest.parent, tmp_path / "copy"))
    cfg = DataConfig(seq_len=512, heldout_fraction=0.2)
    dataset = ManifestDataset(root / MANIFEST, cfg)
    train = dataset.splits["train"]
    images = [i for i in train if dataset.samples[i].modality == "image"]
    audio = next(i for i in train if dataset.samples[i].modality == "audio")
    paths = {i: root / dataset.samples[i].segments[0].path for i in (images[0], images[1], audio)}
    png = paths[images[0]].read_bytes()
    paths[images[0]].write_bytes(png[: len(png) // 2])
    paths[images[1]].unlink()
    wav = paths[audio].read_bytes()
    paths[audio].write_bytes(wav[: len(wav) // 2])
    for i, reason in [(images[0], "unreadable_file"), (images[1], "missing_file"), (audio, "size_mismatch")]:
        with pytest.raises(CorruptSample, match=str(paths[i].name)) as err:
            dataset.decode(i)
        assert err.value.reason == reason
    train_loader = PackedLoader(dataset, cfg)
    docs = [doc for batch in take(iter(train_loader), len(train_loader.plan(0))) for doc in check_batch(batch, cfg)]
    assert len(docs) == len(train) - 3
    assert train_loader.stats == {"unreadable_file": 1, "missing_file": 1, "size_mismatch": 1}


def test_bad_manifest_lines_are_skipped_with_their_line_numbers(tmp_path):
    good = {"id": "x", "segments": [{"type": "text", "text": "ok"}]}
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"id": "y"}),
        json.dumps({"id": "z", "modality": "image", "segments": [{"type": "text", "text": "no image"}]}),
        json.dumps({"id": "w", "segments": [{"type": "image", "path": "a.png", "width": 0, "height": 3}]}),
        json.dumps(good),
    ]
    (tmp_path / MANIFEST).write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning, match="skipped 5 bad lines: line 2"):
        dataset = ManifestDataset(tmp_path / MANIFEST, DataConfig())
    assert len(dataset) == 1 and [n for n, _ in dataset.bad_lines] == [2, 3, 4, 5, 6]
    assert "duplicate" in dataset.bad_lines[-1][1] and "width" in dataset.bad_lines[-2][1]


def test_missing_manifest_errors_name_the_file(tmp_path):
    missing = tmp_path / "nowhere" / MANIFEST
    with pytest.raises(FileNotFoundError, match=str(missing)):
        ManifestDataset(missing, DataConfig())
    with pytest.raises(FileNotFoundError, match=str(missing)):
        ensure_dataset(make_recipe(tmp_path, source="jsonl", path=str(missing.parent)))


# --- profile ---------------------------------------------------------------------------------------------


def hand_tokens(sample: dict) -> int:
    """The token rule written out once more, for the default config (8 px patches, 16 kHz, no downscaling)."""
    total = 2
    for seg in sample["segments"]:
        if seg["type"] == "text":
            total += len(seg["text"].encode())
        elif seg["type"] == "image":
            total += -(-seg["width"] // 8) * -(-seg["height"] // 8)
        else:
            total += (1 + seg["num_samples"] // 160) // 4
    return total


def test_profile_matches_hand_counts(tmp_path):
    recipe = make_recipe(tmp_path)
    profile, figures = profile_dataset(recipe, tmp_path / "profile")
    samples = read_manifest(Path(recipe.data_dir()) / MANIFEST)
    tokens = {s["id"]: hand_tokens(s) for s in samples}
    assert profile.total_samples == profile.manifest_samples == N and profile.total_tokens == sum(tokens.values())
    for modality in ("text", "image", "audio"):
        lengths = [tokens[s["id"]] for s in samples if s["modality"] == modality]
        stats = profile.modalities[modality]
        assert (stats.count, stats.tokens, stats.max) == (len(lengths), sum(lengths), max(lengths))
        assert stats.share == len(lengths) / N and stats.mean == pytest.approx(np.mean(lengths))
        assert stats.p50 == pytest.approx(np.median(lengths)) and sum(stats.hist_counts) == len(lengths)
    train_tokens = sum(n for i, n in tokens.items() if not in_heldout(i, recipe.data.heldout_fraction))
    assert profile.packed_sequences == math.ceil(train_tokens / 512)  # packing this small a set is perfect
    dataset = ManifestDataset(Path(recipe.data_dir()) / MANIFEST, recipe.data)
    assert profile.packed_sequences == len(PackedLoader(dataset, recipe.data, seed=recipe.experiment.seed).plan(0))
    assert profile.packing_efficiency == pytest.approx(train_tokens / (profile.packed_sequences * 512))
    assert profile.skipped == {}
    assert DatasetProfile.load(tmp_path / "profile" / "profile.json") == profile
    assert [f.name for f in figures] == ["token_lengths.png", "modality_shares.png"]
    assert all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in figures)

    capped = recipe.model_copy(update={"data": recipe.data.model_copy(update={"profile_max_samples": 20})})
    small, _ = profile_dataset(capped, tmp_path / "capped")
    assert small.total_samples == 20 and small.manifest_samples == N
    assert sum(m.count for m in small.modalities.values()) == 20
