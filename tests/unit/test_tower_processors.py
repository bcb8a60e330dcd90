"""The pretrained towers' inputs equal transformers' processors' (SigLIP images, Whisper log-mels)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from omni_core.data.tower_processors import ProcessorConfigError, SiglipImageProcessing, WhisperFeatures

transformers = pytest.importorskip("transformers")


def _wave(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_whisper_features_equal_the_feature_extractor(tmp_path, n_mels):
    extractor = transformers.WhisperFeatureExtractor(feature_size=n_mels)
    extractor.save_pretrained(tmp_path)
    features = WhisperFeatures.from_pretrained(tmp_path)
    assert features == WhisperFeatures(feature_size=n_mels)
    wave = _wave(3.37)
    theirs = extractor(wave, sampling_rate=16000, return_tensors="np", return_attention_mask=True)
    ours = features.chunk_features(torch.from_numpy(wave))
    np.testing.assert_allclose(ours.numpy(), theirs["input_features"][0].T, atol=1e-5, rtol=0)
    valid = int(theirs["attention_mask"][0].sum())
    assert features.valid_frames(len(wave)) == valid
    assert features.features(torch.from_numpy(wave)).shape == (valid - valid % 2, n_mels)
    np.testing.assert_allclose(features.mel_filters().numpy(), extractor.mel_filters.T, atol=1e-7, rtol=0)


def test_whisper_features_cut_a_clip_longer_than_the_chunk():
    features = WhisperFeatures()
    wave = torch.from_numpy(_wave(31.0))
    assert features.chunk_features(wave).shape == (3000, 80)
    assert features.features(wave).shape == (3000, 80)


def _image(width: int, height: int, mode: str = "RGB") -> Image.Image:
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA"])
def test_siglip_pixels_equal_the_image_processor(tmp_path, mode):
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    processor = SiglipImageProcessorPil(size={"height": 32, "width": 48})
    processor.save_pretrained(tmp_path)
    processing = SiglipImageProcessing.from_pretrained(tmp_path)
    assert (processing.height, processing.width) == (32, 48)
    img = _image(57, 41, mode)
    theirs = processor(images=img, return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(processing.pixels(img), theirs, atol=1e-5, rtol=0)


def test_siglip_patches_feed_a_conv_patch_embedding_as_a_linear():
    processing = SiglipImageProcessing(height=32, width=48)
    img = _image(40, 30)
    patches, grid = processing.patches(img, patch_size=8)
    assert grid == (4, 6)
    conv = torch.nn.Conv2d(3, 5, kernel_size=8, stride=8)
    pixels = torch.from_numpy(processing.pixels(img))[None]
    expected = conv(pixels)[0].flatten(1).T  # [rows*cols, 5] in row-major grid order
    linear = patches @ conv.weight.reshape(5, -1).T + conv.bias
    torch.testing.assert_close(linear, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"do_center_crop": True, "crop_size": {"height": 8, "width": 8}}, "crop_size"),
        ({"do_center_crop": True}, "do_center_crop"),
        ({"size": {"shortest_edge": 224}}, "size"),
        ({"image_mean": [0.5]}, "image_mean"),
    ],
)
def test_an_image_config_omni_cannot_honour_is_refused_by_name(tmp_path, config, field):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(ProcessorConfigError, match=f"preprocessor_config.json: field '{field}'"):
        SiglipImageProcessing.from_pretrained(tmp_path)


def test_an_audio_config_omni_cannot_honour_is_refused_by_name(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"padding_side": "left"}))
    with pytest.raises(ProcessorConfigError, match="field 'padding_side'"):
        WhisperFeatures.from_pretrained(tmp_path)
    with pytest.raises(ProcessorConfigError, match="no such file"):
        WhisperFeatures.from_pretrained(tmp_path / "absent")
