"""A seeded, learnable on-disk multimodal dataset, so every stage can run end to end with nothing downloaded.

Each sample's content is a deterministic function of what its text says, so a tiny model can learn it in a
few hundred steps: images show one filled shape and are captioned "a red circle on white."; audio clips
are sequences of pure tones from a four-pitch alphabet and are transcribed "do mi la."; text is templated
arithmetic and counting. Same recipe -> byte-identical files (per-sample RNG streams, no timestamps).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
from PIL import Image, ImageDraw

from omni_core.data.dataset import MANIFEST
from omni_core.data.sample import Sample, Segment
from omni_core.recipe.schema import Recipe, SyntheticConfig

log = logging.getLogger(__name__)

GENERATOR_VERSION = 1  # bump when the generated content changes, so stale datasets get regenerated
FINGERPRINT = "synthetic.json"
SHAPES = ("circle", "square", "triangle")
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (20, 20, 20), "gray": (128, 128, 128)}
TONES = {"do": 300.0, "mi": 700.0, "so": 1500.0, "la": 3200.0}  # several mel bins apart
# 160 ms = 16 mel hops = 4 audio embeddings: tone k is embeddings 4k..4k+3, an alignment a debug model picks
# up within ~200 steps (tones of random length, or 6 pitches, were not learned from the audio that fast).
TONE_MS = 160
FADE_MS = 5  # ramps keep repeated tones ("mi mi") audibly separate and clicks out of the spectrum


def _text(rng: np.random.Generator, cfg: SyntheticConfig) -> str:
    """Exactly n words: optionally "a plus b is c," then "count by s: x x+s x+2s ... ."."""
    n_words = int(rng.integers(cfg.text_words.min, cfg.text_words.max + 1))
    words = []
    if n_words >= 9 and rng.random() < 0.5:
        a, b = (int(v) for v in rng.integers(0, 10, size=2))
        words += [str(a), "plus", str(b), "is", f"{a + b},"]
    step, start = int(rng.integers(1, 4)), int(rng.integers(0, 50))
    count = n_words - len(words) - 3
    words += ["count", "by", f"{step}:"] + [str(start + k * step) for k in range(count)]
    return " ".join(words) + "."


def _image(rng: np.random.Generator, cfg: SyntheticConfig) -> tuple[Image.Image, str]:
    """One filled shape, 60-90% of the shorter side, at a random spot of a randomly sized canvas."""
    width, height = (int(v) for v in rng.integers(cfg.image_side_px.min, cfg.image_side_px.max + 1, size=2))
    shape = SHAPES[rng.integers(len(SHAPES))]
    color = list(COLORS)[rng.integers(len(COLORS))]
    background = list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))]
    side = max(3, int(min(width, height) * rng.uniform(0.6, 0.9)))
    x0, y0 = int(rng.integers(0, width - side + 1)), int(rng.integers(0, height - side + 1))
    x1, y1 = x0 + side - 1, y0 + side - 1
    img = Image.new("RGB", (width, height), BACKGROUNDS[background])
    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=COLORS[color])
    elif shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=COLORS[color])
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=COLORS[color])
    return img, f"a {color} {shape} on {background}."


def _audio(rng: np.random.Generator, cfg: SyntheticConfig, sample_rate: int) -> tuple[np.ndarray, str]:
    """int16 PCM of pure tones and their names in order; tones last TONE_MS unless audio_ms holds no
    multiple of it (then they share the nearest allowed duration evenly)."""
    lo = max(1, math.ceil(cfg.audio_ms.min / TONE_MS))
    hi = max(lo, cfg.audio_ms.max // TONE_MS)
    names = [list(TONES)[k] for k in rng.integers(len(TONES), size=int(rng.integers(lo, hi + 1)))]
    duration_ms = min(max(len(names) * TONE_MS, cfg.audio_ms.min), cfg.audio_ms.max)
    total = duration_ms * sample_rate // 1000
    bounds = [total * k // len(names) for k in range(len(names) + 1)]
    pieces = []
    for name, start, stop in zip(names, bounds, bounds[1:]):
        t = np.arange(stop - start) / sample_rate
        fade = np.clip(np.minimum(t, t[::-1]) * 1000 / FADE_MS, 0.0, 1.0)
        pieces.append(0.5 * fade * np.sin(2 * np.pi * TONES[name] * t))
    return np.round(np.concatenate(pieces) * 32767).astype(np.int16), " ".join(names) + "."


def _modalities(recipe: Recipe) -> list[str]:
    """Exactly the mix's shares (largest remainder), in a seeded order."""
    cfg, n = recipe.data.synthetic, recipe.data.synthetic.num_samples
    total = sum(cfg.mix.values())
    quotas = {m: n * share / total for m, share in cfg.mix.items()}
    counts = {m: math.floor(q) for m, q in quotas.items()}
    for m in sorted(quotas, key=lambda m: counts[m] - quotas[m])[: n - sum(counts.values())]:
        counts[m] += 1
    order = [m for m, c in counts.items() for _ in range(c)]
    return [order[j] for j in np.random.default_rng(recipe.experiment.seed).permutation(n)]


def _check_ranges(cfg: SyntheticConfig) -> None:
    least = {"text": ("text_words", 4), "image": ("image_side_px", 4), "audio": ("audio_ms", 20)}
    for modality, (name, minimum) in least.items():
        if cfg.mix.get(modality, 0) > 0 and getattr(cfg, name).min < minimum:
            raise ValueError(f"data.synthetic.{name}.min must be >= {minimum} for the generator's templates")


def _fingerprint(recipe: Recipe) -> dict[str, Any]:
    """Everything the generated bytes depend on."""
    return {
        "version": GENERATOR_VERSION,
        "seed": recipe.experiment.seed,
        "sample_rate": recipe.data.sample_rate,
        "synthetic": recipe.data.synthetic.model_dump(mode="json"),
    }


def _write_sample(root: Path, sample_id: str, modality: str, rng: np.random.Generator, recipe: Recipe) -> Sample:
    cfg, rate = recipe.data.synthetic, recipe.data.sample_rate
    if modality == "image":
        img, caption = _image(rng, cfg)
        path = f"images/{sample_id}.png"
        img.save(root / path)
        image = Segment("image", path=path, width=img.width, height=img.height)
        segments = (image, Segment("text", text=caption))
    elif modality == "audio":
        wave, transcript = _audio(rng, cfg, rate)
        path = f"audio/{sample_id}.wav"
        sf.write(root / path, wave, rate, subtype="PCM_16")
        audio = Segment("audio", path=path, num_samples=len(wave), sample_rate=rate)
        segments = (audio, Segment("text", text=transcript))
    else:
        segments = (Segment("text", text=_text(rng, cfg)),)
    return Sample(sample_id, modality, segments)


def _publish(tmp: Path, out_dir: Path) -> None:
    """Moves a finished dataset into place; whatever was at out_dir is replaced."""
    old = None
    if out_dir.exists():
        old = tmp.with_name(tmp.name + ".old")
        out_dir.rename(old)
    try:
        tmp.rename(out_dir)
    except OSError:
        if not (out_dir / MANIFEST).is_file():
            raise
        shutil.rmtree(tmp)  # another process (rank) published the same deterministic dataset first
    if old is not None:
        shutil.rmtree(old)


def generate_dataset(recipe: Recipe, out_dir: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """Writes the recipe's synthetic dataset to out_dir and returns its manifest path; progress(done, total)
    is called after each sample.

    Everything is written into a temporary folder beside out_dir and renamed into place at the end, so a
    crash leaves no out_dir/manifest.jsonl behind that could pass for a complete dataset."""
    cfg, seed = recipe.data.synthetic, recipe.experiment.seed
    _check_ranges(cfg)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.mkdir()
        (tmp / "images").mkdir()
        (tmp / "audio").mkdir()
        (tmp / FINGERPRINT).write_text(json.dumps(_fingerprint(recipe), indent=2, sort_keys=True) + "\n")
        with (tmp / MANIFEST).open("w", encoding="utf-8") as manifest:
            for i, modality in enumerate(_modalities(recipe)):
                sample = _write_sample(tmp, f"{modality}-{i:06d}", modality, np.random.default_rng([seed, i]), recipe)
                manifest.write(json.dumps(sample.to_json(), ensure_ascii=False) + "\n")
                if progress is not None:
                    progress(i + 1, cfg.num_samples)
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir / MANIFEST


def ensure_dataset(recipe: Recipe) -> Path:
    """Manifest path of the recipe's dataset, generating a synthetic one on first use.

    A synthetic dataset generated from other settings is regenerated; a manifest without a generator
    fingerprint is someone's real data and is used as it is."""
    root = Path(recipe.data_dir())
    manifest = root / MANIFEST
    if recipe.data.source == "jsonl":
        if not manifest.is_file():
            raise FileNotFoundError(f"data.source is 'jsonl' but the manifest {manifest} does not exist")
        return manifest
    stamp = root / FINGERPRINT
    if manifest.is_file():
        if not stamp.is_file() or json.loads(stamp.read_text()) == _fingerprint(recipe):
            return manifest
        log.warning("%s was generated from other settings; regenerating it", root)
    return generate_dataset(recipe, root)
