"""Audio clips -> log-mel frames with torch only (no torchaudio/librosa dependency).

Frames use a 25 ms window and a 10 ms hop (centred STFT), cropped down to a multiple of FRAME_MULTIPLE
because the audio encoder subsamples by 2 (`batch.audio_tokens`); clips too short for MIN_FRAMES frames are
zero-padded up to it. `mel_frames` is the token rule the packer applies to metadata (vectorized over chunks),
so it must agree exactly with `log_mel`. The rules and headers need no tensor, so torch is imported by the
functions that make one: a launch check reads a clip's token count without it.
"""

from __future__ import annotations

import functools
import io
import math
from typing import TYPE_CHECKING

import numpy as np
import soundfile as sf

if TYPE_CHECKING:
    import torch

FRAME_MULTIPLE = 2
MIN_FRAMES = 4


class EmptyAudio(ValueError):
    """A clip with no samples: nothing to encode."""


def _hop(sample_rate: int) -> int:
    return sample_rate // 100


def _window(sample_rate: int) -> int:
    return sample_rate * 25 // 1000


def resampled_length(num_samples, from_rate, to_rate: int):
    """Samples after linear resampling to to_rate (scalars or arrays): round(n * to / from), at least 1."""
    n = np.asarray(num_samples, dtype=np.int64)
    rate = np.asarray(from_rate, dtype=np.int64)
    scaled = np.maximum(1, np.round(n * to_rate / np.maximum(rate, 1))).astype(np.int64)
    length = np.where(rate == to_rate, n, scaled)
    return int(length) if length.ndim == 0 else length


def mel_frames(num_samples, sample_rate: int):
    """Log-mel frames `log_mel` yields for clips of num_samples at sample_rate (centred STFT: 1 + n // hop)."""
    hop = _hop(sample_rate)
    frames = 1 + np.maximum(num_samples, (MIN_FRAMES - 1) * hop) // hop
    frames = frames - frames % FRAME_MULTIPLE
    return int(frames) if np.ndim(frames) == 0 else frames


def read_audio(data: bytes) -> tuple[torch.Tensor, int]:
    """(mono float32 waveform, its sample rate) of a WAV/FLAC file's bytes; channels are averaged."""
    import torch

    if not data:
        raise EmptyAudio("zero-length file")
    wave, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    if not len(wave):
        raise EmptyAudio("no samples")
    return torch.from_numpy(np.ascontiguousarray(wave.mean(axis=1))), rate


def audio_header(data: bytes) -> tuple[int, int]:
    """(num_samples, sample_rate) from the header alone: how sizes are found when a sample carries no metadata."""
    if not data:
        raise EmptyAudio("zero-length file")
    info = sf.info(io.BytesIO(data))
    return info.frames, info.samplerate


def resample(wave: torch.Tensor, from_rate: int, to_rate: int) -> torch.Tensor:
    """Linear resampling: crude, but enough for log-mel features and exactly `resampled_length` long."""
    if from_rate == to_rate:
        return wave
    import torch

    length = resampled_length(len(wave), from_rate, to_rate)
    return torch.nn.functional.interpolate(wave[None, None], size=length, mode="linear", align_corners=False)[0, 0]


@functools.lru_cache(maxsize=8)
def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """[n_mels, n_fft // 2 + 1] triangular filters evenly spaced on the HTK mel scale from 0 Hz to Nyquist."""
    import torch

    def to_mel(hz: torch.Tensor) -> torch.Tensor:
        return 2595.0 * torch.log10(1.0 + hz / 700.0)

    def to_hz(mel: torch.Tensor) -> torch.Tensor:
        return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)

    bins_hz = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = to_hz(torch.linspace(0, float(to_mel(torch.tensor(sample_rate / 2.0))), n_mels + 2, dtype=torch.float64))
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bins_hz - lower) / (centre - lower)
    falling = (upper - bins_hz) / (upper - centre)
    return torch.clamp(torch.minimum(rising, falling), min=0.0).float()


def log_mel(wave: torch.Tensor, sample_rate: int, n_mels: int) -> torch.Tensor:
    """[mel_frames(len(wave)), n_mels] Whisper-style log-mel: log10 power, floored 8 decades below the clip's
    peak, scaled to roughly [-1, 1]."""
    import torch

    hop, win = _hop(sample_rate), _window(sample_rate)
    n_fft = 1 << math.ceil(math.log2(win))
    frames = mel_frames(len(wave), sample_rate)
    wave = torch.nn.functional.pad(wave, (0, max(0, (MIN_FRAMES - 1) * hop - len(wave))))
    window = torch.hann_window(win)
    spec = torch.stft(wave, n_fft, hop, win, window, center=True, pad_mode="constant", return_complex=True)
    power = spec.abs().square()[:, :frames]  # [freq, frames]
    mel = torch.log10(torch.clamp(mel_filterbank(sample_rate, n_fft, n_mels) @ power, min=1e-10))
    mel = torch.maximum(mel, mel.max() - 8.0)
    return ((mel + 4.0) / 4.0).T.contiguous()
