"""Inputs a pretrained tower was trained on: SigLIP's image processing and Whisper's log-mel features, read from
the tower's `preprocessor_config.json` and computed as transformers' `SiglipImageProcessorPil` and
`WhisperFeatureExtractor` compute them, so that an imported tower sees what it saw in training.

The debug flavors keep their own inputs (`data.image.patchify`, `data.audio.log_mel`). A key of the config that
these classes cannot honour is refused by name; keys that only name the processor are ignored.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch

    from omni_core.recipe.data_sections import DataConfig
    from omni_core.recipe.schema import Recipe

CONFIG_FILE = "preprocessor_config.json"
_NAMING_KEYS = frozenset({"image_processor_type", "feature_extractor_type", "processor_class", "auto_map"})
_RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
             3: Image.Resampling.BICUBIC}  # fmt: skip


class ProcessorConfigError(ValueError):
    """A preprocessor config omni cannot honour: names the file and the field. `field`: the recipe field to
    change, where one is known (a launch check reports it there)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def _read_config(folder: str | Path) -> tuple[Path, dict[str, Any]]:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ProcessorConfigError(f"{path}: no such file (the tower's processor config)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ProcessorConfigError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ProcessorConfigError(f"{path}: must hold a JSON object")
    return path, config


def _take(path: Path, config: dict[str, Any], known: dict[str, Any]) -> dict[str, Any]:
    """`known` (key -> default) filled from `config`, refusing keys outside it by name."""
    unknown = sorted(set(config) - set(known) - _NAMING_KEYS)
    if unknown:
        raise ProcessorConfigError(f"{path}: field {unknown[0]!r} is not supported (supported: {sorted(known)})")
    return {key: config.get(key, default) for key, default in known.items()}


@dataclass(frozen=True)
class SiglipImageProcessing:
    """Resize to a fixed size, rescale and normalise: SigLIP's (and CLIP-without-crop's) image processing."""

    height: int = 224
    width: int = 224
    resample: int = 3  # PIL's BICUBIC, as transformers numbers them
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> SiglipImageProcessing:
        path, config = _read_config(folder)
        known = {
            "size": {"height": cls.height, "width": cls.width},
            "resample": cls.resample,
            "rescale_factor": cls.rescale_factor,
            "image_mean": list(cls.image_mean),
            "image_std": list(cls.image_std),
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "do_center_crop": False,
            "default_to_square": False,
        }
        values = _take(path, config, known)
        size = values.pop("size")
        if not isinstance(size, dict) or set(size) != {"height", "width"}:
            raise ProcessorConfigError(f"{path}: field 'size' must be {{'height': H, 'width': W}}, got {size!r}")
        if values.pop("do_center_crop"):
            raise ProcessorConfigError(f"{path}: field 'do_center_crop' true is not supported (SigLIP resizes only)")
        if values["resample"] not in _RESAMPLE:
            raise ProcessorConfigError(f"{path}: field 'resample' {values['resample']!r} is not a known PIL filter")
        for key in ("image_mean", "image_std"):
            if len(values[key]) != 3:
                raise ProcessorConfigError(f"{path}: field {key!r} needs 3 values, got {values[key]!r}")
            values[key] = tuple(float(v) for v in values[key])
        for ignored in ("do_convert_rgb", "default_to_square"):  # RGB always; `size` names both sides
            values.pop(ignored)
        return cls(height=int(size["height"]), width=int(size["width"]), **values)

    def pixels(self, img: Image.Image) -> np.ndarray:
        """[3, height, width] float32 pixel values, as the processor's `pixel_values` for one image."""
        img = img.convert("RGB")
        if self.do_resize and img.size != (self.width, self.height):
            img = img.resize((self.width, self.height), _RESAMPLE[self.resample])
        values = np.asarray(img, dtype=np.float64)
        if self.do_rescale:
            values = values * self.rescale_factor
        if self.do_normalize:
            values = (values - np.asarray(self.image_mean)) / np.asarray(self.image_std)
        return values.astype(np.float32).transpose(2, 0, 1)

    def grid(self, patch_size: int) -> tuple[int, int]:
        """(rows, cols) of every image's patches: the size is fixed, so the grid does not depend on the image."""
        return self.height // patch_size, self.width // patch_size

    def patches(self, img: Image.Image, patch_size: int) -> tuple[torch.Tensor, tuple[int, int]]:
        """The image's patches in `data.image.patchify`'s layout ([rows*cols, 3*p*p], (channel, y, x) each, rows
        in row-major grid order) and its (rows, cols) grid: what a Conv2d patch embedding of the tower reads."""
        import torch

        if self.height % patch_size or self.width % patch_size:
            raise ProcessorConfigError(
                f"image size {self.height}x{self.width} is not a multiple of the tower's patch size {patch_size}"
            )
        rows, cols, p = self.height // patch_size, self.width // patch_size, patch_size
        pixels = torch.from_numpy(self.pixels(img))  # [3, H, W]
        patches = pixels.view(3, rows, p, cols, p).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3 * p * p)
        return patches.contiguous(), (rows, cols)


@dataclass(frozen=True)
class WhisperFeatures:
    """Whisper's log-mel features: 16 kHz audio padded (or cut) to `chunk_length` seconds, a centred 400-point
    STFT every 160 samples with reflected edges, Slaney-normalised mel filters on the Slaney scale up to 8 kHz,
    log10 floored 8 decades below the chunk's peak, scaled by (x + 4) / 4."""

    feature_size: int = 80  # mel bins: 80 (Whisper up to large-v2) or 128 (large-v3, Qwen2-Audio)
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    chunk_length: int = 30

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> WhisperFeatures:
        path, config = _read_config(folder)
        known = {
            "feature_size": cls.feature_size,
            "sampling_rate": cls.sampling_rate,
            "hop_length": cls.hop_length,
            "n_fft": cls.n_fft,
            "chunk_length": cls.chunk_length,
            "n_samples": None,
            "nb_max_frames": None,
            "padding_side": "right",
            "padding_value": 0.0,
            "return_attention_mask": False,
            "dither": 0.0,
        }
        values = _take(path, config, known)
        for key, honoured in (("padding_side", "right"), ("padding_value", 0.0), ("dither", 0.0)):
            if values.pop(key) != honoured:
                raise ProcessorConfigError(f"{path}: field {key!r} must be {honoured!r} (what omni computes)")
        values.pop("return_attention_mask")  # omni derives a clip's frames itself (`valid_frames`)
        n_samples, max_frames = values.pop("n_samples"), values.pop("nb_max_frames")
        made = cls(**{k: int(v) for k, v in values.items()})
        if n_samples not in (None, made.chunk_samples):
            raise ProcessorConfigError(f"{path}: field 'n_samples' must be chunk_length x sampling_rate")
        if max_frames not in (None, made.chunk_frames):
            raise ProcessorConfigError(f"{path}: field 'nb_max_frames' must be n_samples / hop_length")
        return made

    @property
    def chunk_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def chunk_frames(self) -> int:
        return self.chunk_samples // self.hop_length

    def valid_frames(self, num_samples: int) -> int:
        """Frames of a clip's own samples (the rest of the chunk is padding): the extractor's attention mask."""
        return math.ceil(min(num_samples, self.chunk_samples) / self.hop_length)

    def chunk_features(self, wave: torch.Tensor) -> torch.Tensor:
        """[chunk_frames, feature_size] features of the whole chunk, padding included, as the extractor's
        `input_features` (transposed) for a mono float waveform at `sampling_rate`."""
        import torch

        chunk = torch.zeros(self.chunk_samples, dtype=torch.float32)
        length = min(len(wave), self.chunk_samples)
        chunk[:length] = wave[:length].float()
        window = torch.hann_window(self.n_fft)
        spec = torch.stft(chunk, self.n_fft, self.hop_length, window=window, center=True, return_complex=True)
        power = spec[..., :-1].abs() ** 2  # the last frame is dropped, as Whisper's extractor does
        mel = torch.log10(torch.clamp(self.mel_filters() @ power, min=1e-10))
        mel = torch.maximum(mel, mel.max() - 8.0)
        return ((mel + 4.0) / 4.0).T.contiguous()

    def feature_frames(self, num_samples):
        """Frames `features` yields for clips of num_samples (scalar or array): `valid_frames` rounded down to
        even. A clip longer than the chunk is cut to it, as the extractor does; one under two hops has none."""
        clipped = np.minimum(np.asarray(num_samples, dtype=np.int64), self.chunk_samples)
        frames = -(-clipped // self.hop_length)
        frames = frames - frames % 2
        return int(frames) if frames.ndim == 0 else frames

    def features(self, wave: torch.Tensor) -> torch.Tensor:
        """[frames, feature_size]: the chunk's features cut to the clip's own frames, rounded down to even (the
        encoder subsamples by 2, `common.batch.audio_tokens`)."""
        return self.chunk_features(wave)[: self.feature_frames(len(wave))]

    def mel_filters(self) -> torch.Tensor:
        return _slaney_filters(self.sampling_rate, self.n_fft, self.feature_size)


_Processor = TypeVar("_Processor", SiglipImageProcessing, WhisperFeatures)


@dataclass(frozen=True)
class TowerInputs:
    """The inputs of the recipe's pretrained towers: a part is None where its tower is omni's own, whose inputs
    stay `data.image.patchify` and `data.audio.log_mel`. Decoding and the token rule (`sample.measure`) both
    follow it, so they agree under either regime. `audio_pool`: the audio encoder's (`model.audio_pool`), which
    divides a clip's LLM tokens (`batch.audio_tokens`), whatever its tower."""

    vision: SiglipImageProcessing | None = None
    audio: WhisperFeatures | None = None
    audio_pool: int = 1

    @classmethod
    def of_recipe(cls, recipe: Recipe) -> TowerInputs | None:
        """The processors in `model.pretrained`'s vision and audio folders, checked against `recipe.data`
        (`check_data`), and the audio pool; None when the recipe has neither tower nor pool."""
        vision_dir, audio_dir = recipe.model.pretrained.vision, recipe.model.pretrained.audio
        pool = recipe.model.audio_pool
        if vision_dir is None and audio_dir is None and pool == 1:
            return None
        made = cls(_load(SiglipImageProcessing, vision_dir, "vision"), _load(WhisperFeatures, audio_dir, "audio"), pool)
        made.check_data(recipe.data)
        return made

    def check_data(self, cfg: DataConfig) -> None:
        """Refuses, naming the data field, settings the towers' inputs cannot honour."""
        refusals: list[tuple[bool, str, str]] = []  # (refused, field, why)
        if self.vision is not None:
            vision, p = self.vision, cfg.patch_size
            size = f"{vision.height}x{vision.width}"
            patches = (vision.height // p) * (vision.width // p)
            every = f"the vision tower's images are always {patches} patches ({size} pixels)"
            refusals += [
                (bool(vision.height % p or vision.width % p), "patch_size", f"does not divide its image size {size}"),
                (cfg.max_image_patches < patches, "max_image_patches", f"is below {every}"),
                (cfg.video_frame_patches < patches, "video_frame_patches", f"is below {every}"),
                (cfg.min_image_patches > patches, "min_image_patches", f"is above {every}"),
            ]
        if self.audio is not None:
            audio = self.audio
            refusals += [
                (
                    cfg.n_mels != audio.feature_size,
                    "n_mels",
                    f"must be the audio extractor's {audio.feature_size} bins",
                ),
                (
                    cfg.sample_rate != audio.sampling_rate,
                    "sample_rate",
                    f"must be the audio extractor's {audio.sampling_rate} Hz (its sampling_rate)",
                ),
            ]
        for refused, field, why in refusals:
            if refused:
                value = getattr(cfg, field)
                raise ProcessorConfigError(f"data.{field} {value} {why}", f"data.{field}")


def _load(kind: type[_Processor], folder: str | None, part: str) -> _Processor | None:
    """`kind` read from a tower's folder (None where the recipe names none), its errors placed at the field."""
    if folder is None:
        return None
    try:
        return kind.from_pretrained(folder)
    except ProcessorConfigError as error:
        raise ProcessorConfigError(str(error), f"model.pretrained.{part}") from error


def _hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    mel = 3.0 * hz / 200.0
    log_region = hz >= 1000.0
    return np.where(log_region, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) * 27.0 / np.log(6.4), mel)


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    hz = 200.0 * mel / 3.0
    return np.where(mel >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel - 15.0)), hz)


@functools.lru_cache(maxsize=4)
def _slaney_filters(sampling_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """[n_mels, n_fft // 2 + 1] triangular filters evenly spaced on the Slaney scale from 0 Hz to Nyquist, each
    scaled to unit area (Slaney normalisation), as librosa's and Whisper's."""
    import torch

    fft_hz = np.linspace(0, sampling_rate // 2, n_fft // 2 + 1)
    edges = _slaney_mel_to_hz(np.linspace(0.0, _hz_to_slaney_mel(np.array(sampling_rate / 2)), n_mels + 2))
    widths = np.diff(edges)
    offsets = edges[None, :] - fft_hz[:, None]
    falling = -offsets[:, :-2] / widths[:-1]
    rising = offsets[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(falling, rising)) * (2.0 / (edges[2:] - edges[:-2]))[None, :]
    return torch.from_numpy(filters.T.astype(np.float32))
