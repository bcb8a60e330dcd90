"""Data core: synthetic content, token rules, decoding, packing, the loader (sharding, resume, corruption).
Expected values are computed here independently (by hand or from raw files), not by calling the code under
test again. Sources (WebDataset, S3, bad shards) are in test_data_sources.py; profiling, drift and the dynamic
workload in test_data_profile.py."""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from omni_core.common.batch import MODALITY_IDS, PackedBatch, audio_tokens, video_tokens
from omni_core.common.tokenizer import AUDIO_ID, BOS_ID, EOS_ID, IMAGE_ID, PAD_ID, VIDEO_ID
from omni_core.data.audio import log_mel, mel_frames
from omni_core.data.dataset import DecodedSample, ManifestDataset, open_dataset
from omni_core.data.dataset_location import MANIFEST
from omni_core.data.image import patch_grid, patchify
from omni_core.data.loader import ConsumerStream, PackedLoader
from omni_core.data.packing import OVERDUE, BatchPacker, collate
from omni_core.data.profile import profile_dataset
from omni_core.data.source_base import CorruptSample, Record, View, in_heldout
from omni_core.data.synthetic import ensure_dataset, generate_dataset, text_document
from omni_core.data.workload import BACKGROUNDS, COLORS, DIRECTIONS, TONES
from omni_core.recipe.data_sections import DataConfig
from tests.helpers.recipes import build_recipe

N = 60
LOADER_CFG = DataConfig(seq_len=128, micro_batch=2, heldout_fraction=0.2)


DATA = {"experiment.name": "t", "experiment.seed": 3, "data.seq_len": 512, "data.synthetic.num_samples": N}


def read_manifest(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    """One shared generated dataset; tests that damage files work on a copy."""
    return Path(ensure_dataset(build_recipe(tmp_path_factory.mktemp("shared"), DATA)))


def loader(location: Path | str, cfg: DataConfig = LOADER_CFG, **kwargs) -> PackedLoader:
    return PackedLoader(ManifestDataset(location, cfg), cfg, **kwargs)


def one_pass(dataset: ManifestDataset, cfg: DataConfig, split: str = "train", consumer: int = 0,
             consumers: int = 1, seed: int = 0) -> list[list[list[Record]]]:
    """Every batch (as records per sequence) of one consumer's single pass over the split."""
    stream = ConsumerStream(dataset, cfg, View(consumer, consumers, split, seed, one_pass=True, shuffle=True),
                            lambda b: b)
    return list(iter(stream.next_sequences, None))


def records(dataset: ManifestDataset, split: str = "all", consumer: int = 0, consumers: int = 1) -> list[Record]:
    """One pass of a consumer's source stream, before packing (too-long samples included)."""
    stream = dataset.source.stream(View(consumer, consumers, split, 0, one_pass=True, shuffle=True), None, print)
    return list(iter(lambda: stream.next(0), None))


def take(iterator, n: int) -> list[PackedBatch]:
    return [next(iterator) for _ in range(n)]


def documents(batch: PackedBatch) -> list[torch.Tensor]:
    cu = batch.cu_seqlens.tolist()
    return [batch.input_ids[a:b] for a, b in zip(cu, cu[1:])]


def same_batches(a: list[PackedBatch], b: list[PackedBatch]) -> bool:
    def equal(x, y) -> bool:
        return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y

    return len(a) == len(b) and all(equal(getattr(x, k), getattr(y, k)) for x, y in zip(a, b) for k in vars(x))


# --- generated content -----------------------------------------------------------------------------------


def test_generator_is_deterministic_with_exact_mix(tmp_path):
    recipe = build_recipe(tmp_path, DATA)
    a, b = generate_dataset(recipe, tmp_path / "a").parent, generate_dataset(recipe, tmp_path / "b").parent
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert len(files) > N // 2
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    assert Counter(s["modality"] for s in read_manifest(a / MANIFEST)) == {"text": 24, "image": 24, "audio": 12}
    other_seed = build_recipe(tmp_path, {**DATA, "experiment.seed": 4})
    assert generate_dataset(other_seed, tmp_path / "c").read_bytes() != (a / MANIFEST).read_bytes()


def test_crashed_generation_leaves_nothing_that_looks_complete(tmp_path):
    recipe = build_recipe(tmp_path, DATA)
    out = Path(recipe.data_dir())

    def crash(done: int, total: int) -> None:
        if done == 10:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_dataset(recipe, out, progress=crash)
    assert not out.exists() and list(out.parent.iterdir()) == []
    assert Path(ensure_dataset(recipe)) == out / MANIFEST and len(read_manifest(out / MANIFEST)) == N


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_synthetic_generation_never_replaces_data_it_did_not_write(tmp_path, kind):
    theirs = tmp_path / ("records.json" if kind == "file" else "shards")
    if kind == "file":
        theirs.write_text("[]")
    else:
        theirs.mkdir()
        (theirs / "part-0.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=f"data.path {theirs} holds data omni did not generate"):
        ensure_dataset(build_recipe(tmp_path, {**DATA, "data.path": str(theirs)}))
    assert (theirs.read_text() if kind == "file" else (theirs / "part-0.jsonl").read_text()) in ("[]", "{}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name]  # nothing moved or left beside it


def test_ensure_dataset_regenerates_only_its_own_stale_data(tmp_path):
    def samples(num_samples: int) -> dict:
        return {**DATA, "data.synthetic.num_samples": num_samples}

    manifest = Path(ensure_dataset(build_recipe(tmp_path, samples(20))))
    assert len(read_manifest(manifest)) == 20
    assert len(read_manifest(Path(ensure_dataset(build_recipe(tmp_path, samples(30)))))) == 30  # settings changed
    (manifest.parent / "synthetic.json").unlink()  # now it looks like someone's real data: never overwrite
    assert len(read_manifest(Path(ensure_dataset(build_recipe(tmp_path, samples(40)))))) == 30


def test_captions_describe_the_drawn_shape_and_colors(manifest):
    names = {rgb: name for name, rgb in {**COLORS, **BACKGROUNDS}.items()}
    fill_ratio = {"square": 1.0, "circle": math.pi / 4, "triangle": 0.5}
    images = [s for s in read_manifest(manifest) if s["modality"] == "image"]
    for sample in images:
        seg, caption = sample["segments"][0], sample["segments"][1]["text"]
        pixels = np.asarray(Image.open(manifest.parent / seg["path"]).convert("RGB"))
        assert pixels.shape == (seg["height"], seg["width"], 3)
        border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
        background = Counter(map(tuple, border)).most_common(1)[0][0]
        colors = Counter(map(tuple, pixels.reshape(-1, 3)))
        shape_rgb, shape_count = next((c, n) for c, n in colors.most_common() if c != background)
        _, color, shape, _, bg = caption.rstrip(".").split()
        assert (names[shape_rgb], names[background]) == (color, bg), sample["id"]
        ys, xs = np.nonzero((pixels == shape_rgb).all(axis=2))
        box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
        assert shape_count / box == pytest.approx(fill_ratio[shape], abs=0.12), sample["id"]


def test_transcripts_name_the_tones_in_order(manifest):
    for sample in (s for s in read_manifest(manifest) if s["modality"] == "audio"):
        seg, words = sample["segments"][0], sample["segments"][1]["text"].rstrip(".").split()
        wave, rate = sf.read(manifest.parent / seg["path"])
        assert (len(wave), rate) == (seg["num_samples"], seg["sample_rate"]) == (len(words) * 2560, 16000)
        bounds = [len(wave) * k // len(words) for k in range(len(words) + 1)]
        for word, a, b in zip(words, bounds, bounds[1:]):
            spectrum = np.abs(np.fft.rfft(wave[a:b], n=8 * rate // 10))  # 1.25 Hz bins
            assert abs(np.argmax(spectrum) * 1.25 - TONES[word]) < 20, (sample["id"], word)


@pytest.mark.parametrize("tokens", [15, 16, 17, 31, 32, 33, 100, 40_000])
def test_text_documents_have_exact_lengths_and_count_right(tokens):
    for seed in range(5):
        text = text_document(np.random.default_rng(seed), tokens)
        assert len(text.encode()) == tokens and text.endswith(".")
        counting = text.split("count by ")[1].rstrip(".")
        step, *numbers = counting.replace(":", "").split()
        assert all(len(n) == 2 for n in numbers)
        assert all((int(b) - int(a)) % 100 == int(step) for a, b in zip(numbers, numbers[1:]))
        assert tokens - len(text.rstrip(".")) <= 3


def test_video_clips_move_as_their_captions_say(tmp_path):
    videos = {**DATA, "data.synthetic.num_samples": 12, "data.synthetic.mix": {"video": 1.0},
              "data.synthetic.video_frames": {"min": 5, "max": 9}}
    manifest = Path(ensure_dataset(build_recipe(tmp_path, videos)))
    for sample in read_manifest(manifest):
        seg, caption = sample["segments"][0], sample["segments"][1]["text"]
        color, direction = caption.split()[1], caption.rstrip(".").split()[-1]
        assert direction in DIRECTIONS
        clip = Image.open(manifest.parent / seg["path"])
        assert (clip.n_frames, clip.width, clip.height) == (seg["num_frames"], seg["width"], seg["height"])
        centres = []
        for k in range(clip.n_frames):
            clip.seek(k)
            pixels = np.asarray(clip.convert("RGB"), dtype=int)
            ys, xs = np.nonzero(np.abs(pixels - COLORS[color]).sum(axis=2) < 60)
            centres.append((xs.mean(), ys.mean()))
        axis, sign = {"left": (0, -1), "right": (0, 1), "up": (1, -1), "down": (1, 1)}[direction]
        moves = [sign * (b[axis] - a[axis]) for a, b in zip(centres, centres[1:])]
        assert all(m >= 0 for m in moves) and sum(moves) > 0, sample["id"]


# --- token rules and decoding ----------------------------------------------------------------------------


def test_patch_grid_keeps_aspect_within_budget():
    assert patch_grid(17, 9, 8, 64) == (2, 3)
    assert patch_grid(64, 64, 8, 64) == (8, 8)
    for width, height in [(800, 600), (1000, 10), (3, 5000), (65, 64)]:
        rows, cols = patch_grid(width, height, 8, 64)
        assert 1 <= rows * cols <= 64
        assert rows * cols >= 40 or min(rows, cols) == 1  # no needless shrinking
    assert patch_grid(800, 600, 8, 64) == (6, 9)
    assert patch_grid(8, 8, 8, 64, min_patches=16) == (4, 4)  # upscaled, square stays square
    assert patch_grid(20, 10, 8, 64, min_patches=8) == (2, 4)  # 2:1 kept
    widths, heights = np.random.default_rng(0).integers(1, 3000, size=(2, 500))
    rows, cols = patch_grid(widths, heights, 14, 256, 16)  # vectorized = scalar, always within budget
    assert [(int(r), int(c)) for r, c in zip(rows, cols)] == [patch_grid(w, h, 14, 256, 16)
                                                              for w, h in zip(widths, heights)]
    assert (rows * cols >= 16).all() and (rows * cols <= 256).all()


def test_patchify_is_row_major_channel_first():
    pixels = np.arange(2 * 4 * 3, dtype=np.uint8).reshape(2, 4, 3) * 10  # h=2, w=4
    patches, grid = patchify(Image.fromarray(pixels), patch_size=2, max_patches=8)
    assert grid == (1, 2) and patches.shape == (2, 12)
    expected = torch.from_numpy(pixels[:, 2:4, :].astype(np.float32)).permute(2, 0, 1).reshape(-1) / 127.5 - 1
    assert torch.allclose(patches[1], expected)


@pytest.mark.parametrize("num_samples", [1, 159, 160, 479, 480, 640, 11376])
def test_log_mel_frames_follow_the_token_rule(num_samples):
    by_hand = max(4, (1 + num_samples // 160) // 2 * 2)  # 10 ms hop at 16 kHz, centred, even
    mels = log_mel(torch.randn(num_samples), 16000, 32)
    assert mels.shape == (by_hand, 32) == (mel_frames(num_samples, 16000), 32)


def test_log_mel_puts_pitch_in_the_right_band():
    t = torch.arange(8000) / 16000
    peaks = [log_mel(torch.sin(2 * math.pi * f * t), 16000, 32).mean(0).argmax().item() for f in TONES.values()]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)


def test_jsonl_source_decodes_foreign_formats(tmp_path):
    """JPEG over the patch budget, stereo WAV at another rate, a text-only line: counts match decodes."""
    Image.new("RGB", (200, 50), (200, 10, 10)).save(tmp_path / "wide.jpg")
    sf.write(tmp_path / "stereo.wav", np.zeros((4000, 2)), 8000, subtype="PCM_16")
    lines = [
        {"id": "a", "segments": [
            {"type": "text", "text": "see "}, {"type": "image", "path": "wide.jpg", "width": 200, "height": 50}]},
        {"id": "b", "segments": [{"type": "audio", "path": "stereo.wav", "num_samples": 4000, "sample_rate": 8000}]},
        {"id": "c", "modality": "text", "segments": [{"type": "text", "text": "héllo"}]},
    ]
    (tmp_path / MANIFEST).write_text("".join(json.dumps(line) + "\n" for line in lines))
    recipe = build_recipe(tmp_path, {**DATA, "data.source": "jsonl", "data.path": tmp_path})
    dataset = open_dataset(recipe)
    by_id = {r.id: r for r in records(dataset)}
    image, audio, text = (dataset.decode(by_id[k]) for k in "abc")
    assert image.image_grids == [(4, 16)] and image.image_patches[0].shape == (64, 192)
    assert image.input_ids == [BOS_ID, *b"see ", *[IMAGE_ID] * 64, EOS_ID] and image.modality == "image"
    assert audio.audio_mels[0].shape == (50, 32)  # 0.5 s resampled to 16 kHz: 1 + 8000 // 160 = 51 -> 50
    assert audio.input_ids == [BOS_ID, *[AUDIO_ID] * 25, EOS_ID] and by_id["b"].tokens == 27
    assert text.input_ids == [BOS_ID, *"héllo".encode(), EOS_ID] and by_id["c"].tokens == 8


def test_jsonl_media_paths_outside_the_manifests_folder_are_skipped_unread(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (16, 16)).save(data / "inside.png")
    Image.new("RGB", (16, 16)).save(tmp_path / "secret.png")
    image = {"type": "image", "width": 16, "height": 16}
    lines = [{"id": name, "segments": [{**image, "path": path}]}
             for name, path in [("ok", "inside.png"), ("up", "../secret.png"), ("abs", str(tmp_path / "secret.png")),
                                ("url", "s3://other/secret.png")]]
    (data / MANIFEST).write_text("".join(json.dumps(line) + "\n" for line in lines))
    recipe = build_recipe(data, {**DATA, "data.source": "jsonl", "data.path": data})
    from omni_core.data.profile import profile_dataset

    profile, _ = profile_dataset(recipe, tmp_path / "profile")
    assert profile.total_samples == 1 and profile.skipped == {"unsafe_path": 3}


# --- packing ---------------------------------------------------------------------------------------------


def test_collate_labels_positions_and_boundaries_by_hand():
    cfg = DataConfig(seq_len=16, micro_batch=2, patch_size=2, n_mels=4)
    text = DecodedSample([BOS_ID, 104, 105, EOS_ID])
    image = DecodedSample([BOS_ID, IMAGE_ID, IMAGE_ID, 97, EOS_ID], "image", [torch.ones(2, 12)], [(1, 2)])
    audio = DecodedSample([BOS_ID, AUDIO_ID, AUDIO_ID, 120, EOS_ID], "audio", audio_mels=[torch.zeros(4, 4)])
    long_text = DecodedSample([BOS_ID, *range(65, 74), EOS_ID])  # 11 tokens: fills sequence 2 exactly
    batch = collate([[text, image], [audio, long_text]], cfg)
    X = -100
    assert batch.input_ids.tolist() == (
        [BOS_ID, 104, 105, EOS_ID] + [BOS_ID, IMAGE_ID, IMAGE_ID, 97, EOS_ID] + [PAD_ID] * 7
        + [BOS_ID, AUDIO_ID, AUDIO_ID, 120, EOS_ID] + [BOS_ID, *range(65, 74), EOS_ID]
    )
    assert batch.labels.tolist() == (
        [104, 105, EOS_ID, X] + [X, X, 97, EOS_ID, X] + [X] * 7
        + [X, X, 120, EOS_ID, X] + [*range(65, 74), EOS_ID, X]
    )
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, *range(7), *range(5), *range(11)]
    assert batch.cu_seqlens.tolist() == [0, 4, 9, 16, 21, 32] and batch.cu_seqlens.dtype == torch.int32
    assert batch.loss_modality.tolist() == [0] * 4 + [1] * 5 + [0] * 7 + [2] * 5 + [0] * 11
    assert batch.image_grids.tolist() == [[1, 2]] and batch.image_patches.shape == (2, 12)
    assert batch.audio_frames.tolist() == [4] and batch.audio_mels.shape == (4, 4)
    assert batch.num_samples == 4 and batch.num_loss_tokens == 17
    with pytest.raises(ValueError, match="seq_len"):
        collate([[long_text, long_text]], cfg)


def test_collate_splits_padding_so_attention_over_it_stays_linear():
    """A long sequence's padding is documents of at most PAD_DOC tokens; real documents are untouched."""
    from omni_core.data.packing import PAD_DOC

    cfg = DataConfig(seq_len=1000, micro_batch=1, patch_size=2, n_mels=4)
    text = DecodedSample([BOS_ID, 104, 105, EOS_ID])
    failed = DecodedSample.padding(300)  # a sample that did not decode
    batch = collate([[text, failed]], cfg)
    lengths = batch.cu_seqlens.diff().tolist()
    assert lengths[0] == 4 and sum(lengths) == 1000 and max(lengths[1:]) == PAD_DOC == 128
    assert lengths[1:] == [128, 128, 44] + [128] * 5 + [56]  # the failed sample's 300, then the 696 left
    assert batch.num_samples == 1 and (batch.input_ids[4:] == PAD_ID).all() and (batch.labels[3:] == -100).all()


class Item:
    def __init__(self, ordinal: int, tokens: int) -> None:
        self.ordinal, self.tokens = ordinal, tokens


def pack_all(sizes: list[int], bins: int, capacity: int, lookahead: float = 1.5) -> list[list[list[Item]]]:
    packer: BatchPacker[Item] = BatchPacker(bins, capacity, lookahead)
    batches = []
    for i, size in enumerate(sizes):
        packer.add(Item(i, size))
        while packer.ready:
            batches.append(packer.pack())
    while packer.pool:
        batches.append(packer.pack())
    return batches


@pytest.mark.parametrize("low,high,bins", [(5, 60, 1), (5, 60, 4), (1, 2, 2), (100, 129, 1)])
def test_batch_packer_places_every_item_once_within_capacity_and_densely(low, high, bins):
    sizes = np.random.default_rng(0).integers(low, high, size=2000).tolist()
    batches = pack_all(sizes, bins, 128)
    assert all(len(batch) == bins for batch in batches)
    placed = [item.ordinal for batch in batches for seq in batch for item in seq]
    assert sorted(placed) == list(range(2000))
    loads = [sum(item.tokens for item in seq) for batch in batches for seq in batch]
    assert max(loads) <= 128
    efficiency = sum(sizes) / (128 * len(loads))
    assert efficiency > (0.97 if high <= 60 else 0.84)  # items of 100-128 tokens: one per sequence at best
    def ordinals(batches: list[list[list[Item]]]) -> list:
        return [[[i.ordinal for i in s] for s in b] for b in batches]

    assert ordinals(batches) == ordinals(pack_all(sizes, bins, 128))
    packer: BatchPacker[Item] = BatchPacker(bins, 128, 1.5)  # by slices, as the profile packs: the same batches
    items = [Item(i, size) for i, size in enumerate(sizes)]
    filled = [*packer.fill(items[:777]), *packer.fill(items[777:778]), *packer.fill(items[778:])]
    while packer.pool:
        filled.append(packer.pack())
    assert ordinals(filled) == ordinals(batches)


def test_batch_packer_keeps_stream_order_at_batch_scale():
    """Modalities differ in length; packing must not sort the whole stream by length (a run's first steps
    would see one modality): every item lands within a few batches of where the stream put it."""
    sizes = [60 if i % 3 == 0 else 10 for i in range(3000)]  # long "images" between short "texts"
    batches = pack_all(sizes, 1, 128)
    for b, batch in enumerate(batches):
        for item in batch[0]:
            expected_batch = item.ordinal * len(batches) / len(sizes)
            assert abs(b - expected_batch) <= 2 + OVERDUE, (b, item.ordinal)
    first = [item.tokens for batch in batches[:5] for item in batch[0]]
    assert {10, 60} <= set(first)


# --- the loader ------------------------------------------------------------------------------------------


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
        modality = next((m for m, p in (("image", IMAGE_ID), ("audio", AUDIO_ID), ("video", VIDEO_ID)) if p in doc),
                        "text")
        assert (batch.loss_modality[a:b] == MODALITY_IDS[modality]).all()
        real.append(tuple(doc.tolist()))
    assert batch.num_samples == len(real)
    grids = batch.image_grids
    assert (ids == IMAGE_ID).sum() == len(batch.image_patches) == int((grids[:, 0] * grids[:, 1]).sum())
    frames = batch.audio_frames.tolist()
    assert (ids == AUDIO_ID).sum() == sum(audio_tokens(f) for f in frames)
    assert len(batch.audio_mels) == sum(frames) and all(f % 2 == 0 for f in frames)
    videos = batch.video_grids.tolist()
    assert (ids == VIDEO_ID).sum() == sum(video_tokens(f, r, c, 2, 1) for f, r, c in videos)
    assert len(batch.video_patches) == sum(f * r * c for f, r, c in videos)
    return real


def train_ids(manifest: Path, fraction: float) -> list[str]:
    return [s["id"] for s in read_manifest(manifest) if not in_heldout(s["id"], fraction)]


def test_one_pass_holds_every_train_sample_exactly_once_and_whole(manifest):
    dataset = ManifestDataset(manifest, LOADER_CFG)
    stream = ConsumerStream(dataset, LOADER_CFG, View(0, 1, "train", 0, one_pass=True, shuffle=True), lambda b: b)
    batches = list(iter(stream.next_batch, None))
    seen = Counter(doc for batch in batches for doc in check_batch(batch, LOADER_CFG))
    samples = {s["id"]: s for s in read_manifest(manifest)}
    expected = Counter()
    for sample_id in train_ids(manifest, 0.2):
        text = "".join(seg.get("text", "") for seg in samples[sample_id]["segments"]).encode()
        expected[text] += 1
    assert Counter(bytes(t for t in doc if t < 256) for doc in seen.elements()) == expected
    first_half = [doc for batch in batches[: len(batches) // 2] for doc in check_batch(batch, LOADER_CFG)]
    assert {IMAGE_ID, AUDIO_ID} <= {t for doc in first_half for t in doc}  # not sorted by length (= modality)


def test_split_is_stable_and_too_long_samples_are_counted(manifest, tmp_path):
    cfg = LOADER_CFG.model_copy(update={"seq_len": 40})
    reordered = tmp_path / MANIFEST
    reordered.write_text("".join(reversed(manifest.read_text().splitlines(keepends=True))))

    def heldout_ids(location: Path) -> set[str]:
        return {r.id for r in records(ManifestDataset(location, cfg), "heldout")}

    all_ids = {s["id"] for s in read_manifest(manifest)}
    assert heldout_ids(reordered) == heldout_ids(manifest) == all_ids - set(train_ids(manifest, 0.2))
    assert 0 < len(heldout_ids(manifest)) < N // 2
    tokens = [r.tokens for r in records(ManifestDataset(manifest, cfg), "train")]
    too_long = sum(t > 40 for t in tokens)
    stream = ConsumerStream(ManifestDataset(manifest, cfg), cfg, View(0, 1, "train", 0, True, True), lambda b: b)
    docs = [doc for batch in iter(stream.next_batch, None) for doc in check_batch(batch, cfg)]
    assert too_long > 0 and stream.stats == {"too_long": too_long}
    assert len(docs) == len(tokens) - too_long


def test_consumers_split_a_single_manifest_disjointly(manifest):
    """One shard, three consumers (ranks x workers): each keeps every third record."""
    dataset = ManifestDataset(manifest, LOADER_CFG)
    for split, expected in [("all", [s["id"] for s in read_manifest(manifest)]), ("train", train_ids(manifest, 0.2))]:
        shares = [{r.id for r in records(dataset, split, c, 3)} for c in range(3)]
        assert set().union(*shares) == set(expected) and sum(map(len, shares)) == len(expected)
    assert [len(records(dataset, "all", c, 3)) for c in range(3)] == [N // 3] * 3


@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_loader_yields_exactly_the_remaining_batches(manifest, workers):
    cfg = LOADER_CFG.model_copy(update={"num_workers": workers})
    reference = loader(manifest, cfg, rank=1, world_size=2, seed=7)
    stream = iter(reference)
    take(stream, 5)
    state = json.loads(json.dumps(reference.state_dict()))  # as a checkpoint would store it
    expected = take(stream, 9)  # crosses into the next epoch
    del stream
    assert state["consumers"][0]["pending"] and reference.state_dict()["consumers"][0]["position"][0] >= 1
    resumed = loader(manifest, cfg, rank=1, world_size=2, seed=7)
    resumed.load_state_dict(state)
    assert same_batches(expected, take(iter(resumed), 9))
    fresh = take(iter(loader(manifest, cfg, rank=1, world_size=2, seed=7)), 1)
    assert not same_batches(fresh, expected[-1:])  # the comparison can tell batches apart
    with pytest.raises(ValueError, match="world_size"):
        loader(manifest, cfg, world_size=3, seed=7).load_state_dict(state)


def test_files_that_fail_to_decode_are_skipped_and_counted(manifest, tmp_path):
    root = Path(shutil.copytree(manifest.parent, tmp_path / "copy"))
    cfg = DataConfig(seq_len=512, heldout_fraction=0.2)
    samples = [s for s in read_manifest(root / MANIFEST) if s["id"] in set(train_ids(root / MANIFEST, 0.2))]
    images = [s for s in samples if s["modality"] == "image"]
    audio = [s for s in samples if s["modality"] == "audio"]
    paths = [root / s["segments"][0]["path"] for s in (images[0], images[1], audio[0], audio[1])]
    png = paths[0].read_bytes()
    paths[0].write_bytes(png[: len(png) // 2])
    paths[1].unlink()
    wav = paths[2].read_bytes()
    paths[2].write_bytes(wav[: len(wav) // 2])
    paths[3].write_bytes(b"")
    dataset = ManifestDataset(root / MANIFEST, cfg)
    by_id = {r.id: r for r in records(dataset)}
    for sample, reason in zip((images[0], images[1], audio[0], audio[1]),
                              ("unreadable_file", "missing_file", "size_mismatch", "empty_audio")):
        with pytest.raises(CorruptSample, match=sample["segments"][0]["path"]) as err:
            dataset.decode(by_id[sample["id"]])
        assert err.value.reason == reason
    stream = ConsumerStream(dataset, cfg, View(0, 1, "train", 0, one_pass=True, shuffle=False), lambda b: b)
    docs = [doc for batch in iter(stream.next_batch, None) for doc in check_batch(batch, cfg)]
    assert len(docs) == len(samples) - 4
    assert stream.stats == {"unreadable_file": 1, "missing_file": 1, "size_mismatch": 1, "empty_audio": 1}


def test_bad_manifest_lines_are_skipped_counted_and_logged_with_their_line(tmp_path, caplog):
    good = {"id": "x", "segments": [{"type": "text", "text": "ok"}]}
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"id": "y"}),
        "",
        json.dumps({"id": "z", "modality": "image", "segments": [{"type": "text", "text": "no image"}]}),
        json.dumps({"id": "w", "segments": [{"type": "image", "path": "a.png", "width": 0, "height": 3}]}),
        json.dumps({"id": "u", "segments": [{"type": ["image"]}]}),  # an unhashable type
        json.dumps({**good, "id": "v"}),
    ]
    (tmp_path / MANIFEST).write_text("\n".join(lines) + "\n")
    recipe = build_recipe(tmp_path, {**DATA, "data.source": "jsonl", "data.path": tmp_path})
    with caplog.at_level(logging.WARNING, logger="omni_core.data.sources"):
        profile, _ = profile_dataset(recipe, tmp_path / "profile")
    assert profile.total_samples == 2 and profile.skipped == {"bad_record": 5}
    warnings = [r.getMessage() for r in caplog.records]
    for line, why in [(2, "not JSON"), (3, "segments"), (5, "does not match"), (6, "'width' >= 1"), (7, "'type' in")]:
        assert any(f"{MANIFEST}: skipped entry {line}: bad_record" in w and why in w for w in warnings), (line, why)


def test_missing_dataset_errors_name_the_location(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        ManifestDataset(missing / MANIFEST, DataConfig(source="jsonl"))
    with pytest.raises(FileNotFoundError, match=str(missing)):
        ensure_dataset(build_recipe(tmp_path, {**DATA, "data.source": "wds", "data.path": missing}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no \*\.tar shard"):
        ManifestDataset(tmp_path / "empty", DataConfig(source="wds"))
