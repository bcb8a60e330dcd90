"""The dynamic workload (length distributions, mix schedule, on-the-fly source), the streaming profiler (exact
statistics, packing, FLOPs, drift) and `omni data generate`."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import orjson
import pytest

from flows.cli import main
from omni_core.common.tokenizer import AUDIO_ID, IMAGE_ID
from omni_core.data.dataset import ManifestDataset, open_dataset
from omni_core.data.dataset_location import MANIFEST
from omni_core.data.flops import FlopModel
from omni_core.data.loader import PackedLoader
from omni_core.data.profile import profile_dataset, profile_source
from omni_core.data.profile_result import DatasetProfile
from omni_core.data.profiler import Profiler
from omni_core.data.sample import KINDS, Sample, Segments, measure
from omni_core.data.source_base import View
from omni_core.data.synthetic import TRAIN, dataset_specs, ensure_dataset, generate_dataset, sample_of
from omni_core.data.workload import MixSchedule, draw_at_steps, draw_lengths, segments_of, uniforms
from omni_core.models.flavors import get_flavor
from omni_core.recipe import load_recipe
from omni_core.recipe.data_sections import DataConfig, LengthDist, SyntheticConfig
from tests.helpers.recipes import build_recipe, write_recipe


def schedule(steps: int) -> dict:
    """Image:text from 1:9 to 9:1 over `steps` steps, audio taking half the samples 5 steps in every 20."""
    return {"schedule": [{"step": 0, "mix": {"text": 0.9, "image": 0.1}},
                         {"step": steps, "mix": {"text": 0.1, "image": 0.9}}],
            "bursts": [{"modality": "audio", "share": 0.5, "start": 10, "steps": 5, "every": 20}]}


SCHEDULE = schedule(100)


PROFILE = {"experiment.name": "p", "experiment.seed": 11, "data.seq_len": 512, "data.synthetic.num_samples": 60}


# --- workload --------------------------------------------------------------------------------------------


def test_mix_schedule_interpolates_by_step_with_bursts():
    schedule = MixSchedule(SyntheticConfig(**SCHEDULE))
    text, image, audio = (KINDS.index(m) for m in ("text", "image", "audio"))
    assert schedule.at(0)[[text, image, audio]] == pytest.approx([0.9, 0.1, 0.0])
    assert schedule.at(45)[[text, image]] == pytest.approx([0.54, 0.46])  # 45% of the way, between bursts
    assert schedule.at(500)[[text, image]] == pytest.approx([0.1, 0.9])  # held after the last point
    at_12 = schedule.at(12)  # inside the first burst: audio takes half, the rest keeps its proportions
    assert at_12[audio] == pytest.approx(0.5) and at_12[text] / at_12[image] == pytest.approx(0.804 / 0.196)
    assert schedule.at(15)[audio] == 0 and schedule.at(31)[audio] == pytest.approx(0.5)  # every 20 steps
    rows = schedule.at(np.arange(200))
    assert rows.shape == (200, len(KINDS)) and np.allclose(rows.sum(axis=1), 1.0)
    assert schedule.horizon == 100 and not schedule.stationary and MixSchedule(SyntheticConfig()).stationary


def test_draws_are_seeded_and_independent_of_chunking():
    cfg = SyntheticConfig(mix={"text": 0.3, "image": 0.3, "audio": 0.2, "video": 0.2})
    schedule = MixSchedule(cfg)
    whole = draw_at_steps(cfg, schedule, 7, TRAIN, np.arange(1000), 0)
    pieces = [draw_at_steps(cfg, schedule, 7, TRAIN, np.arange(a, a + 100), 0) for a in range(0, 1000, 100)]
    assert [r for p in pieces for r in p.rows()] == whole.rows()
    assert whole.rows() != draw_at_steps(cfg, schedule, 8, TRAIN, np.arange(1000), 0).rows()
    u = uniforms(7, TRAIN, np.arange(100_000), 0)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01


@pytest.mark.parametrize("dist,check", [
    (LengthDist(min=10, max=20), lambda x: set(np.unique(x)) == set(range(10, 21))),
    (LengthDist(min=16, max=32767, kind="lognormal", center=260, spread=1.0),
     lambda x: abs(np.median(x) - 260) < 10 and abs(x.mean() - 260 * math.exp(0.5)) < 15),
    (LengthDist(min=1000, max=30000, kind="normal", center=12700, spread=3500),
     lambda x: abs(x.mean() - 12700) < 60 and abs(x.std() - 3500) < 60),
])
def test_length_distributions_have_their_stated_shape(dist, check):
    index = np.arange(200_000)
    values = draw_lengths(dist, uniforms(0, 0, index, 1), uniforms(0, 0, index, 2))
    assert values.min() >= dist.min and values.max() <= dist.max and check(values)


def test_generated_metadata_measures_exactly_like_the_written_files(tmp_path):
    """The vectorized metadata (what the dynamic source packs by) equals what the written samples measure."""
    recipe = build_recipe(tmp_path, {**PROFILE, "data.synthetic": {
        "num_samples": 50, "mix": {"text": 0.25, "image": 0.25, "audio": 0.25, "video": 0.25}, "long_doc_share": 0.3,
        "long_doc_tokens": {"min": 300, "max": 400}}})
    manifest = generate_dataset(recipe, tmp_path / "d")
    written = [Sample.from_json(json.loads(line)) for line in manifest.read_text().splitlines()]
    specs = next(dataset_specs(recipe.data.synthetic, recipe.experiment.seed, 50))
    columns = Segments.of(written), segments_of(specs, recipe.data.sample_rate)
    for name in Segments.__dataclass_fields__:
        assert getattr(columns[0], name).tolist() == getattr(columns[1], name).tolist(), name
    from_files, from_specs = (measure(c, 50, recipe.data) for c in columns)
    assert from_files.tokens.tolist() == from_specs.tokens.tolist()
    assert from_files.segment_tokens == from_specs.segment_tokens
    assert max(from_files.tokens) > 300  # long documents were drawn


def test_dynamic_loader_follows_the_schedule_by_step_and_resumes_exactly(tmp_path):
    recipe = build_recipe(tmp_path, {**PROFILE, "data.synthetic": SCHEDULE, "data.source": "dynamic",
                                     "data.seq_len": 256})
    assert ensure_dataset(recipe) == "dynamic"
    dataset = ManifestDataset("dynamic", recipe.data)
    batches = [b for _, b in zip(range(110), PackedLoader(dataset, recipe.data, "train", 0, 1, 4))]

    def share(batch, placeholder: int) -> float:
        docs = batch.cu_seqlens.diff().tolist()
        ids = batch.input_ids.split(docs)
        return sum(bool((d == placeholder).any()) for d in ids) / batch.num_samples

    early, late = (np.mean([share(b, IMAGE_ID) for b in batches[a:a + 10]]) for a in (0, 100))
    assert early < 0.25 and late > 0.7
    bursts = [np.mean([share(b, AUDIO_ID) for b in batches[s:s + 5]]) for s in (11, 31, 51, 71, 91)]
    quiet = [np.mean([share(b, AUDIO_ID) for b in batches[s:s + 5]]) for s in (1, 21, 41, 61, 81)]
    assert min(bursts) > 0.25 and max(quiet) < 0.15

    reference = PackedLoader(dataset, recipe.data, "train", 0, 1, 4)
    stream = iter(reference)
    [next(stream) for _ in range(13)]
    state = json.loads(json.dumps(reference.state_dict()))
    assert state["consumers"][0]["pending"]  # samples drawn at earlier steps wait in the packer
    expected = [next(stream) for _ in range(6)]
    resumed = PackedLoader(dataset, recipe.data, "train", 0, 1, 4)
    resumed.load_state_dict(state)
    for a, (_, b) in zip(expected, zip(range(6), resumed)):
        assert all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("input_ids", "image_patches", "audio_mels"))
    assert sum(b.num_samples for b in PackedLoader(dataset, recipe.data, "heldout")) == 3  # 5% of 60 samples


def test_training_and_evaluation_run_on_the_dynamic_source(tmp_path):
    import torch

    from omni_core.runtime.dist import DistInfo
    from omni_core.runtime.evaluate import evaluate_checkpoint
    from omni_core.runtime.trainer import train

    recipe = build_recipe(tmp_path, {"experiment.name": "dyn", "experiment.seed": 1, "data.source": "dynamic",
                                     "data.seq_len": 256, "data.synthetic": {"num_samples": 200, **SCHEDULE},
                                     "train.steps": 2, "train.warmup_steps": 1})
    result = train(recipe, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), log=print)
    assert result.steps == 2 and math.isfinite(result.final_loss)
    assert math.isfinite(evaluate_checkpoint(recipe).loss)


# --- profile ---------------------------------------------------------------------------------------------


def hand_tokens(sample: dict) -> int:
    """The token rule written out once more, for the default config (8 px patches, 16 kHz, no rescaling)."""
    total = 2
    for seg in sample["segments"]:
        if seg["type"] == "text":
            total += len(seg["text"].encode())
        elif seg["type"] == "image":
            total += -(-seg["width"] // 8) * -(-seg["height"] // 8)
        else:
            total += (1 + seg["num_samples"] // 160) // 2
    return total


def test_profile_matches_hand_counts(tmp_path):
    recipe = build_recipe(tmp_path, {**PROFILE, "data.profile_window": 25})
    profile, figures = profile_dataset(recipe, tmp_path / "profile")
    samples = [json.loads(line) for line in (Path(recipe.data_dir()) / MANIFEST).read_text().splitlines()]
    tokens = {s["id"]: hand_tokens(s) for s in samples}
    assert profile.total_samples == profile.manifest_samples == 60 and profile.total_tokens == sum(tokens.values())
    for modality in ("text", "image", "audio"):
        lengths = [tokens[s["id"]] for s in samples if s["modality"] == modality]
        stats = profile.modalities[modality]
        assert (stats.count, stats.tokens, stats.max) == (len(lengths), sum(lengths), max(lengths))
        assert stats.share == len(lengths) / 60 and stats.mean == pytest.approx(np.mean(lengths))
        for q in (50, 90, 99):
            assert getattr(stats, f"p{q}") == pytest.approx(np.percentile(lengths, q))
        counts, edges = np.histogram(lengths, bins=np.array(stats.hist_edges))
        assert stats.hist_counts == counts.tolist() and sum(stats.hist_counts) == len(lengths)
    flops = FlopModel.for_flavor("debug", patch_size=8, n_mels=32)
    text = [tokens[s["id"]] for s in samples if s["modality"] == "text"]
    assert profile.modalities["text"].llm_flops_mean == pytest.approx(np.mean([flops.llm(t) for t in text]))
    assert profile.modalities["text"].encoder_flops_mean == 0 < profile.modalities["image"].encoder_flops_mean
    assert profile.packed_sequences == math.ceil(sum(tokens.values()) / 512)  # dense enough to need no more
    assert profile.packing_efficiency == pytest.approx(sum(tokens.values()) / (profile.packed_sequences * 512))
    assert profile.sequences.real_tokens_mean == pytest.approx(profile.packing_efficiency * 512)
    assert profile.skipped == {} and [w.start for w in profile.windows] == [0, 25]  # a last 10 is too few
    assert not profile.drift_detected
    assert DatasetProfile.load(tmp_path / "profile" / "profile.json") == profile
    assert [f.name for f in figures] == ["token_lengths.png", "modality_shares.png", "mix_over_time.png",
                                         "drift.png", "packing.png"]
    assert all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in figures)

    small = profile_source(open_dataset(recipe), recipe.data, 11, flops, limit=20)
    assert small.total_samples == 20 and sum(m.count for m in small.modalities.values()) == 20


@pytest.mark.parametrize("flavor", ["debug", "vit-1b+llama-12b"])
def test_sample_flops_are_the_models_own_counts(flavor):
    from omni_core.models import flops as model

    args = get_flavor(flavor, patch_size=14, n_mels=128)
    flops = FlopModel.for_flavor(flavor, patch_size=14, n_mels=128)
    image, (rows, cols), frames = 30 * 20, (30, 20), 1200
    video = (5, 4, 6)  # sampled frames of 4 x 6 patches: 3 merged frames, 72 placeholders
    assert flops.llm(777) == pytest.approx(3 * model.llm_forward_flops(args.llm, [777]))
    expected = (model.omni_train_flops(args, [1], [(rows, cols)], [frames], [video])
                - 3 * model.llm_forward_flops(args.llm, [1]))
    patches = video[0] * video[1] * video[2]
    measured = flops.encoder(image + patches, image**2 + video[0] * (patches // video[0]) ** 2, image + 72, frames,
                             (frames // 2) ** 2)
    assert measured == pytest.approx(expected, rel=1e-3 if args.spatial_merge > 1 else 1e-9)  # merge: edges


@pytest.mark.parametrize("synthetic,drifts", [(schedule(500), True), ({}, False)])
def test_drift_is_flagged_on_a_schedule_and_not_on_a_stationary_mix(tmp_path, synthetic, drifts):
    """3,000 samples of ~40 tokens at seq_len 256 are ~500 steps: the whole schedule."""
    recipe = build_recipe(tmp_path, {**PROFILE, "data.synthetic": {"num_samples": 3000, **synthetic},
                                     "data.source": "dynamic", "data.seq_len": 256, "data.profile_window": 250})
    profile, _ = profile_dataset(recipe, tmp_path / "profile")
    assert len(profile.windows) == 12 and profile.drift_detected == drifts
    flagged = [w.drift for w in profile.windows]
    if drifts:
        assert not flagged[1] and all(flagged[-6:])  # the image share grows steadily past the threshold
        assert profile.windows[-1].mix_distance > 0.5 and profile.windows[-1].ks > profile.drift_threshold
    else:  # windows of 250 differ by chance (KS ~0.1), but not significantly
        assert not any(flagged) and max(w.ks for w in profile.windows) > 0


def test_profiler_memory_does_not_grow_with_the_stream():
    cfg = DataConfig(source="dynamic", seq_len=256, profile_window=500, synthetic={"num_samples": 15_000})
    dataset = ManifestDataset("dynamic", cfg)
    profiler = Profiler(cfg, FlopModel.for_flavor("debug", patch_size=8, n_mels=32))
    stream = dataset.source.stream(View(0, 1, "train", 0, one_pass=True, shuffle=False), None, print)
    sizes = []
    for n in range(15_000):
        record = stream.next(profiler.batches)
        profiler.add(record, packable=True)
        if n % 5_000 == 4_999:
            sizes.append((len(profiler.rows) + profiler.pending_count, len(profiler.loads),
                          len(profiler.packer.items), max(len(c.counts) for c in profiler.lengths.values())))
    assert all(buffer < 500 and loads < 500 and pool < 40 and counts < 300 for buffer, loads, pool, counts in sizes)
    assert len(profiler.windows) == 30  # one small summary per window is all that accumulates


BAD_LINES = [  # (line, why the record-by-record stream skips it)
    (b"{not json", "bad_record"),
    (b'{"id": "no-segments"}', "bad_record"),
    (b'{"id": "odd-type", "segments": [{"type": ["image"]}]}', "bad_record"),
    (b'{"id": "wrong", "modality": "audio", "segments": [{"type": "text", "text": "t"}]}', "bad_record"),
    (b'{"id": "huge", "segments": [{"type": "image", "path": "h.png", "width": 9000, "height": 9000}]}',
     "oversized_image"),
    (b'{"id": "mute", "segments": [{"type": "audio", "path": "m.wav", "num_samples": 0, "sample_rate": 8000}]}',
     "empty_audio"),
    (b"", ""),  # a blank line is no record
]


def drifting_manifest(folder: Path, num: int, shards: int) -> Counter:
    """A metadata-only JSONL dataset (media are never opened) in `shards` files: four modalities whose mix
    drifts, long documents over seq_len 512, and every 37th line one of BAD_LINES. Returns the skips due."""
    syn = SyntheticConfig(
        num_samples=num, long_doc_share=0.1, long_doc_tokens={"min": 200, "max": 900},
        schedule=[{"step": 0, "mix": {"text": 0.7, "image": 0.1, "audio": 0.1, "video": 0.1}},
                  {"step": 100, "mix": {"text": 0.1, "image": 0.3, "audio": 0.2, "video": 0.4}}])
    lines, bad = [], Counter()
    for specs in dataset_specs(syn, 3, num):
        for spec in specs.rows():
            kind = KINDS[spec.modality]
            text = "w" * (spec.text_tokens if kind == "text" else 5 + spec.index % 40)
            lines.append(orjson.dumps(sample_of(spec, f"{kind}-{spec.index}", text, 16000, f"{kind}.bin").to_json()))
            if len(lines) % 37 == 0:
                line, why = BAD_LINES[len(lines) // 37 % len(BAD_LINES)]
                lines.append(line)
                if why:
                    bad[why] += 1
    folder.mkdir()
    for k in range(shards):
        (folder / f"part-{k}.jsonl").write_bytes(b"\n".join(lines[k * len(lines) // shards:
                                                                (k + 1) * len(lines) // shards]) + b"\n")
    return bad


def test_columnar_profile_equals_the_record_by_record_one(tmp_path):
    """The metadata profile reads sharded sources as columns, CHUNK records at a time; record by record (the
    path decoding takes) must give the same profile, to the bit: statistics, packing, drift, skips (and the
    order of their reasons), with or without a limit that ends mid-chunk."""
    location = tmp_path / "m"
    bad = drifting_manifest(location, 4000, shards=3)
    cfg = DataConfig(source="jsonl", path=str(location), profile_window=300, micro_batch=2)
    dataset = ManifestDataset(location, cfg)
    flops = FlopModel.for_flavor("debug", patch_size=cfg.patch_size, n_mels=cfg.n_mels)
    for limit in (None, 1, 1024, 2500):
        columns = profile_source(dataset, cfg, 0, flops, limit)
        by_record = profile_source(dataset, cfg, 0, flops, limit, by_record=True)
        assert columns.model_dump_json() == by_record.model_dump_json(), limit
        if limit is None:
            assert set(columns.modalities) == set(KINDS) and columns.drift_detected
            too_long = columns.skipped.pop("too_long")
            assert columns.skipped == bad and too_long > 50 and columns.manifest_samples == 4000 + bad.total()
        else:
            assert columns.total_samples == limit


# --- command line ----------------------------------------------------------------------------------------


def test_data_generate_writes_the_recipe_as_jsonl_or_webdataset(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", {"experiment.name": "g", "data.synthetic.shard_size": 8}, tmp_path)
    assert main(["data", "generate", str(recipe), "--out", str(tmp_path / "w"), "--format", "wds", "--num", "20"]) == 0
    assert sorted(p.name for p in (tmp_path / "w").glob("*.tar")) == [f"shard-00000{k}.tar" for k in range(3)]
    assert "wrote 20 samples" in capsys.readouterr().out
    assert main(["data", "generate", str(recipe), "--out", str(tmp_path / "j"),
                 "--set", "data.synthetic.num_samples=9"]) == 0
    assert len((tmp_path / "j" / MANIFEST).read_text().splitlines()) == 9
    assert main(["data", "generate", str(recipe), "--out", str(tmp_path / "x"), "--num", "0"]) == 2
    assert "--num must be at least 1" in capsys.readouterr().err


def test_dynamic_mix_recipe_is_valid_and_real_scale():
    recipe = load_recipe(Path(__file__).parents[2] / "recipes" / "dynamic_mix.yaml")
    assert recipe.data.source == "dynamic" and recipe.data.synthetic.long_doc_tokens.max <= recipe.data.seq_len
