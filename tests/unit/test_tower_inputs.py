"""A pretrained tower's inputs in the data path: where the recipe names a vision or audio tower, decoding prepares
images, video frames and audio as the tower's processor config says (data.tower_processors), and the token rule
(`sample.measure`) counts exactly what decoding yields; the settings that cannot fit the towers are refused by name.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from omni_core.data.audio import resample
from omni_core.data.dataset import ManifestDataset
from omni_core.data.source_base import View
from omni_core.data.tower_processors import ProcessorConfigError, TowerInputs, WhisperFeatures
from omni_core.recipe.data_sections import DataConfig
from omni_core.recipe.schema import Recipe
from omni_core.runtime.preflight import _tower_inputs
from tests.helpers.hf_parts import write_audio, write_vision
from tests.helpers.models import N_MELS, PATCH_SIZE
from tests.helpers.recipes import build_recipe

TOWER_GRID = 8 * 8  # tests.helpers.hf_parts' SigLIP: 64-pixel images, 8-pixel patches
CFG = DataConfig(source="jsonl", seq_len=4096, patch_size=PATCH_SIZE, n_mels=N_MELS, max_image_patches=TOWER_GRID,
                 video_frame_patches=TOWER_GRID, video_max_frames=3)


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("towers")
    return {"vision": str(write_vision(root / "vision")), "audio": str(write_audio(root / "audio"))}


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Images of sizes unlike the tower's, a three-frame GIF, and clips at 8 and 44.1 kHz (one longer than
    Whisper's 30 s chunk) and one at 16 kHz too short for a single pair of frames."""
    root = tmp_path_factory.mktemp("manifest")
    rng = np.random.default_rng(0)
    records = []
    for i, (w, h) in enumerate([(37, 23), (100, 61), (64, 64)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"im{i}.png")
        records.append({"id": f"image-{i}", "segments": [{"type": "image", "path": f"im{i}.png", "width": w,
                                                          "height": h}, {"type": "text", "text": f"picture {i}"}]})
    frames = [Image.fromarray(rng.integers(0, 256, (30, 50, 3), dtype=np.uint8)) for _ in range(3)]
    frames[0].save(root / "clip.gif", save_all=True, append_images=frames[1:], duration=100)
    records.append({"id": "video-0", "segments": [{"type": "video", "path": "clip.gif", "width": 50, "height": 30,
                                                   "num_frames": 3}, {"type": "text", "text": "a clip"}]})
    for i, (rate, samples) in enumerate([(8000, 12345), (44100, 44100 * 31), (16000, 16001), (16000, 150)]):
        sf.write(root / f"a{i}.wav", rng.uniform(-0.5, 0.5, samples).astype(np.float32), rate, subtype="FLOAT")
        records.append({"id": f"audio-{i}", "segments": [{"type": "audio", "path": f"a{i}.wav", "num_samples": samples,
                                                          "sample_rate": rate}, {"type": "text", "text": "a sound"}]})
    path = root / "manifest.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def tower_recipe(parts: dict[str, str], **data: int) -> Recipe:
    """A recipe with the tiny towers, its data settings fitting them but for `data`'s."""
    fitting = {"max_image_patches": TOWER_GRID, "video_frame_patches": TOWER_GRID, "patch_size": PATCH_SIZE,
               "n_mels": N_MELS}
    return build_recipe(None, {f"model.pretrained.{p}": folder for p, folder in parts.items()}
                        | {f"data.{key}": value for key, value in (fitting | data).items()})


def towers_of(parts: dict[str, str]) -> TowerInputs:
    towers = TowerInputs.of_recipe(tower_recipe(parts))
    assert towers is not None and towers.vision is not None and towers.audio is not None
    return towers


def one_pass(dataset: ManifestDataset) -> tuple[list, list[str]]:
    skipped: list[str] = []
    stream = dataset.source.stream(View(0, 1, "all", 0, one_pass=True, shuffle=False), None, skipped.append)
    return list(iter(lambda: stream.next(0), None)), skipped


@pytest.mark.parametrize("with_towers", [True, False])
def test_measure_counts_what_decoding_yields(parts, manifest, with_towers) -> None:
    dataset = ManifestDataset(manifest, CFG, towers=towers_of(parts) if with_towers else None)
    records, skipped = one_pass(dataset)
    # Whisper's extractor gives a 150-sample clip no pair of frames: the rule skips it, as an empty clip
    assert skipped == (["empty_audio"] if with_towers else [])
    assert len(records) == 8 - len(skipped)
    assert_measured(dataset, records, with_towers)


def test_dynamic_samples_are_measured_as_the_towers_take_them(parts) -> None:
    synthetic = {"num_samples": 16, "mix": {"text": 0.1, "image": 0.3, "audio": 0.3, "video": 0.3}}
    cfg = CFG.model_copy(update={"source": "dynamic", "synthetic": CFG.synthetic.model_copy(update=synthetic)})
    dataset = ManifestDataset("dynamic", cfg, towers=towers_of(parts))
    records, _ = one_pass(dataset)
    assert {record.modality for record in records} >= {"image", "audio", "video"}
    assert_measured(dataset, records, with_towers=True)


def assert_measured(dataset: ManifestDataset, records: list, with_towers: bool) -> None:
    """Each record's measured tokens, patches and frames are what decoding it yields."""
    for record in records:
        doc = dataset.decode(record)
        assert len(doc.input_ids) == record.tokens, record.id
        patches = sum(len(p) for p in doc.image_patches + doc.video_patches)
        assert patches == record.vision_tokens, record.id
        assert sum(len(m) for m in doc.audio_mels) == record.audio_frames, record.id
        if with_towers:
            assert all(grid == (8, 8) for grid in doc.image_grids), record.id
            assert all(grid[1:] == (8, 8) for grid in doc.video_grids), record.id


def test_decoded_inputs_are_the_processors(parts, manifest) -> None:
    towers = towers_of(parts)
    assert towers.vision is not None and towers.audio is not None
    dataset = ManifestDataset(manifest, CFG, towers=towers)
    folder = manifest.parent
    by_id = {record.id: record for record in one_pass(dataset)[0]}
    image = Image.open(folder / "im1.png").convert("RGB")
    assert torch.equal(dataset.decode(by_id["image-1"]).image_patches[0], towers.vision.patches(image, PATCH_SIZE)[0])
    gif = Image.open(folder / "clip.gif")
    frames = []
    for k in range(3):
        gif.seek(k)
        frames.append(towers.vision.patches(gif.convert("RGB"), PATCH_SIZE)[0])
    assert torch.equal(dataset.decode(by_id["video-0"]).video_patches[0], torch.cat(frames))
    for i, name in enumerate(["audio-0", "audio-1", "audio-2"]):
        wave, rate = sf.read(io.BytesIO((folder / f"a{i}.wav").read_bytes()), dtype="float32")
        expected = towers.audio.features(resample(torch.from_numpy(wave), rate, 16000))
        mels = dataset.decode(by_id[name]).audio_mels[0]
        assert mels.shape[1] == N_MELS and torch.equal(mels, expected), name
    assert len(dataset.decode(by_id["audio-1"]).audio_mels[0]) == 3000  # cut at the 30 s chunk


def test_feature_frames_is_the_features_length() -> None:
    features = WhisperFeatures(feature_size=N_MELS)
    lengths = [1, 159, 160, 320, 321, 479, 16000, 16161, features.chunk_samples, features.chunk_samples + 5000]
    counted = features.feature_frames(np.array(lengths))
    for length, frames in zip(lengths, counted.tolist(), strict=True):
        wave = torch.linspace(-0.3, 0.3, length)
        assert len(features.features(wave)) == frames == features.feature_frames(length), length
        assert frames % 2 == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_image_patches", 63), ("video_frame_patches", 16), ("min_image_patches", 65), ("patch_size", 12),
     ("n_mels", 80), ("sample_rate", 22050)],
)
def test_settings_the_towers_cannot_take_are_refused_by_name(parts, field, value) -> None:
    roomy = {"max_image_patches": 100} if field == "min_image_patches" else {}  # min > max is the schema's to refuse
    recipe = tower_recipe(parts, **roomy, **{field: value})
    with pytest.raises(ProcessorConfigError, match=f"data.{field} {value} ") as refused:
        TowerInputs.of_recipe(recipe)
    assert refused.value.field == f"data.{field}"
    [finding] = _tower_inputs(recipe)
    assert finding.field == f"data.{field}"


def test_a_tower_without_its_processor_config_is_refused_at_its_field(parts, tmp_path) -> None:
    bare = tmp_path / "vision"
    bare.mkdir()
    recipe = build_recipe(None, {"model.pretrained.vision": str(bare), "data.max_image_patches": TOWER_GRID})
    [finding] = _tower_inputs(recipe)
    assert finding.field == "model.pretrained.vision" and "preprocessor_config.json" in finding.message
    assert TowerInputs.of_recipe(build_recipe(None, {})) is None
