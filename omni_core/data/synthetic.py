"""Learnable synthetic samples, so every stage can run end to end with nothing downloaded: drawn on the fly
(`dynamic_source.DynamicSource`, data.source=dynamic) or written to disk as a JSONL manifest or WebDataset shards.

Each sample's content is a deterministic function of what its text says, so a tiny model can learn it in a
few hundred steps: images show one filled shape and are captioned "a red circle on white."; video clips show
one moving ("a red circle moves left."); audio clips are 160 ms pure tones from a four-pitch alphabet,
transcribed "do mi la."; text counts in fixed-width numbers ("count by 3: 05 08 11."). Lengths and the mix come
from `workload.py`; contents are rendered from a per-sample seed only when a sample is decoded or written, so
the same recipe gives byte-identical files and identical on-the-fly samples.
"""

from __future__ import annotations

import io
import json
import logging
import os
import secrets
import shutil
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import soundfile as sf
from PIL import Image, ImageDraw

from omni_core.data.dataset_location import FINGERPRINT, MANIFEST, dataset_location, fingerprint
from omni_core.data.sample import KINDS, Sample, Segment
from omni_core.data.workload import (
    BACKGROUNDS,
    COLORS,
    DIRECTIONS,
    MODALITY_CODE,
    SHAPES,
    TONE_MS,
    TONES,
    MixSchedule,
    Spec,
    Specs,
    check_templates,
    draw_at_steps,
    draw_specs,
)
from omni_core.recipe.data_sections import Modality, SyntheticConfig
from omni_core.recipe.schema import Recipe

log = logging.getLogger(__name__)

FADE_MS = 5  # ramps keep repeated tones ("mi mi") audibly separate and clicks out of the spectrum
TRAIN, HELDOUT = 0, 1  # hash streams: held-out samples are drawn apart from training ones
WRITE_CHUNK = 4096

# --- content ---------------------------------------------------------------------------------------------


def text_document(rng: np.random.Generator, tokens: int) -> str:
    """Exactly `tokens` bytes: optionally "a plus b is cc, ", then "count by s:" and two-digit numbers counting
    up modulo 100, then one to three dots."""
    words = []
    if tokens >= 32 and rng.random() < 0.5:
        a, b = (int(v) for v in rng.integers(0, 10, size=2))
        words.append(f"{a} plus {b} is {a + b:02d},")
    step, start = int(rng.integers(1, 4)), int(rng.integers(0, 100))
    words.append(f"count by {step}:")
    head = " ".join(words)
    count = (tokens - len(head) - 1) // 3
    numbers = "".join(f" {(start + k * step) % 100:02d}" for k in range(count))
    return head + numbers + "." * (tokens - len(head) - 3 * count)


def caption(spec: Spec) -> str:
    color, shape = list(COLORS)[spec.color], SHAPES[spec.shape]
    if KINDS[spec.modality] == "video":
        return f"a {color} {shape} moves {DIRECTIONS[spec.direction]}."
    return f"a {color} {shape} on {list(BACKGROUNDS)[spec.background]}."


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill: tuple) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)


def image(spec: Spec, rng: np.random.Generator) -> Image.Image:
    """One filled shape, 60-90% of the shorter side, at a random spot."""
    img = Image.new("RGB", (spec.width, spec.height), list(BACKGROUNDS.values())[spec.background])
    side = max(3, int(min(spec.width, spec.height) * rng.uniform(0.6, 0.9)))
    x0, y0 = int(rng.integers(0, spec.width - side + 1)), int(rng.integers(0, spec.height - side + 1))
    _draw_shape(
        ImageDraw.Draw(img),
        SHAPES[spec.shape],
        (x0, y0, x0 + side - 1, y0 + side - 1),
        list(COLORS.values())[spec.color],
    )
    return img


def video(spec: Spec, rng: np.random.Generator) -> list[Image.Image]:
    """The shape (half the shorter side) crossing the frame in its direction. The corner pixel blinks, so no
    two consecutive frames are equal: GIF/WebP writers would merge them and change the frame count."""
    side = max(2, min(spec.width, spec.height) // 2)
    travel_x, travel_y = spec.width - side, spec.height - side
    across = rng.uniform(0, 1)
    frames = []
    for k in range(spec.frames):
        t = k / max(1, spec.frames - 1)
        t = {"left": 1 - t, "right": t, "up": 1 - t, "down": t}[DIRECTIONS[spec.direction]]
        horizontal = DIRECTIONS[spec.direction] in ("left", "right")
        x0 = round((t if horizontal else across) * travel_x)
        y0 = round((across if horizontal else t) * travel_y)
        frame = Image.new("RGB", (spec.width, spec.height), list(BACKGROUNDS.values())[spec.background])
        _draw_shape(
            ImageDraw.Draw(frame),
            SHAPES[spec.shape],
            (x0, y0, x0 + side - 1, y0 + side - 1),
            list(COLORS.values())[spec.color],
        )
        frame.putpixel((0, 0), (255, 255, 255) if k % 2 else (0, 0, 0))
        frames.append(frame)
    return frames


def tones(names: list[str], sample_rate: int) -> np.ndarray:
    """int16 PCM: each name's pure tone for TONE_MS, with short fades."""
    length = TONE_MS * sample_rate // 1000
    t = np.arange(length) / sample_rate
    fade = np.clip(np.minimum(t, t[::-1]) * 1000 / FADE_MS, 0.0, 1.0)
    wave = np.concatenate([0.5 * fade * np.sin(2 * np.pi * TONES[name] * t) for name in names])
    return np.round(wave * 32767).astype(np.int16)


def content(spec: Spec, seed: int, stream: int, sample_rate: int, with_media: bool) -> tuple[str, Any]:
    """(the sample's text, its media or None): a PIL image, a list of frames, or int16 PCM."""
    rng = np.random.default_rng([seed, stream, spec.index])
    modality = KINDS[spec.modality]
    if modality == "text":
        return text_document(rng, spec.text_tokens), None
    if modality == "audio":
        names = [list(TONES)[k] for k in rng.integers(len(TONES), size=spec.tones)]
        return " ".join(names) + ".", tones(names, sample_rate) if with_media else None
    if not with_media:
        return caption(spec), None
    return caption(spec), image(spec, rng) if modality == "image" else video(spec, rng)


def sample_of(spec: Spec, sample_id: str, text: str, sample_rate: int, path: str = "") -> Sample:
    """The metadata record of a generated sample: its media segment (if any, at `path`), then its text."""
    modality = KINDS[spec.modality]
    segments = [Segment("text", text=text)]
    if modality in ("image", "video"):
        frames = spec.frames if modality == "video" else 0
        segments.insert(0, Segment(modality, path=path, width=spec.width, height=spec.height, num_frames=frames))
    elif modality == "audio":
        samples = spec.tones * TONE_MS * sample_rate // 1000
        segments.insert(0, Segment("audio", path=path, num_samples=samples, sample_rate=sample_rate))
    return Sample(sample_id, modality, segments)


# --- on disk ---------------------------------------------------------------------------------------------


def exact_modalities(mix: dict[Modality, float], num: int, seed: int) -> np.ndarray:
    """Modality codes with exactly the mix's shares (largest remainder), in a seeded order."""
    total = sum(mix.values())
    quotas = {m: num * share / total for m, share in mix.items()}
    counts = {m: int(np.floor(q)) for m, q in quotas.items()}
    for m in sorted(quotas, key=lambda m: counts[m] - quotas[m])[: num - sum(counts.values())]:
        counts[m] += 1
    order = np.concatenate([np.full(c, MODALITY_CODE[m], dtype=np.int64) for m, c in counts.items()])
    return order[np.random.default_rng(seed).permutation(num)]


def dataset_specs(syn: SyntheticConfig, seed: int, num: int) -> Iterator[Specs]:
    """A written dataset's samples in order, chunk by chunk. Without a schedule the shares are exact; with one,
    sample i is drawn at step i * horizon / num, so reading the data in order replays the schedule."""
    schedule = MixSchedule(syn)
    exact = exact_modalities(syn.mix, num, seed) if schedule.stationary else None
    for start in range(0, num, WRITE_CHUNK):
        index = np.arange(start, min(num, start + WRITE_CHUNK))
        if exact is not None:
            yield draw_specs(syn, seed, TRAIN, index, exact[index])
        else:
            yield draw_at_steps(syn, schedule, seed, TRAIN, index, index * schedule.horizon / num)


def encode_media(kind: str, media: Any, sample_rate: int) -> tuple[str, bytes]:
    """(file extension, file bytes) of generated media: PNG, animated GIF (1 frame/s), 16-bit WAV."""
    out = io.BytesIO()
    if kind == "image":
        media.save(out, "PNG")
        return "png", out.getvalue()
    if kind == "video":
        media[0].save(out, "GIF", save_all=True, append_images=media[1:], duration=1000, loop=0)
        return "gif", out.getvalue()
    sf.write(out, media, sample_rate, format="WAV", subtype="PCM_16")
    return "wav", out.getvalue()


class _JsonlWriter:
    """manifest.jsonl beside images/, video/ and audio/ folders."""

    FOLDERS: ClassVar[dict[str, str]] = {"image": "images", "video": "video", "audio": "audio"}

    def __init__(self, root: Path) -> None:
        self.root = root
        for folder in self.FOLDERS.values():
            (root / folder).mkdir()
        self.manifest = (root / MANIFEST).open("w", encoding="utf-8")

    def add(self, sample: Sample, media: tuple[str, bytes] | None) -> None:
        if media is not None:
            ext, data = media
            sample.segments[0].path = f"{self.FOLDERS[sample.modality]}/{sample.id}.{ext}"
            (self.root / sample.segments[0].path).write_bytes(data)
        self.manifest.write(json.dumps(sample.to_json(), ensure_ascii=False) + "\n")

    def close(self) -> None:
        self.manifest.close()


class _WdsWriter:
    """shard-000000.tar, ...: per sample `id.json` (segments naming members), `id.<media>` and `id.txt`."""

    def __init__(self, root: Path, shard_size: int) -> None:
        self.root, self.shard_size = root, shard_size
        self.tar: tarfile.TarFile | None = None
        self.count = 0

    @staticmethod
    def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o644, 0  # fixed metadata: byte-identical shards
        tar.addfile(info, io.BytesIO(data))

    def _shard(self) -> tarfile.TarFile:
        """The shard the next sample goes into: a new one every shard_size samples."""
        if self.tar is None or self.count % self.shard_size == 0:
            self.close()
            # open across add() calls, until the next shard's or close(): no `with` can span them
            self.tar = tarfile.open(  # noqa: SIM115
                self.root / f"shard-{self.count // self.shard_size:06d}.tar", "w", format=tarfile.USTAR_FORMAT
            )
        return self.tar

    def add(self, sample: Sample, media: tuple[str, bytes] | None) -> None:
        tar = self._shard()
        self.count += 1
        text = sample.segments[-1]
        members = {"txt": text.text.encode("utf-8")}
        text.path, text.text = "txt", ""
        if media is not None:
            sample.segments[0].path = media[0]
            members[media[0]] = media[1]
        self._member(tar, f"{sample.id}.json", json.dumps(sample.to_json()).encode())
        for ext, data in members.items():
            self._member(tar, f"{sample.id}.{ext}", data)

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()


def _publish(tmp: Path, out_dir: Path) -> None:
    """Moves a finished dataset into place; whatever was at out_dir is replaced."""
    old = None
    if out_dir.exists():
        old = tmp.with_name(tmp.name + ".old")
        out_dir.rename(old)
    try:
        tmp.rename(out_dir)
    except OSError:
        if not (out_dir / FINGERPRINT).is_file():
            raise
        shutil.rmtree(tmp)  # another process (rank) published the same deterministic dataset first
    if old is not None:
        shutil.rmtree(old)


def generate_dataset(
    recipe: Recipe,
    out_dir: Path,
    progress: Callable[[int, int], None] | None = None,
    *,
    fmt: str | None = None,
    num: int | None = None,
) -> Path:
    """Writes the recipe's synthetic dataset (data.synthetic.format and num_samples unless given) to out_dir
    and returns its location: the manifest for JSONL, the folder of shards for WebDataset. progress(done,
    total) is called after each sample.

    Everything is written into a temporary folder beside out_dir and renamed into place at the end, so a
    crash leaves nothing at out_dir that could pass for a complete dataset."""
    syn, seed, rate = recipe.data.synthetic, recipe.experiment.seed, recipe.data.sample_rate
    check_templates(syn)
    fmt, num = fmt or syn.format, num or syn.num_samples
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.mkdir()
        (tmp / FINGERPRINT).write_text(json.dumps(fingerprint(recipe, fmt, num), indent=2, sort_keys=True) + "\n")
        writer = _JsonlWriter(tmp) if fmt == "jsonl" else _WdsWriter(tmp, syn.shard_size)
        done = 0
        for specs in dataset_specs(syn, seed, num):
            for spec in specs.rows():
                text, media = content(spec, seed, TRAIN, rate, with_media=True)
                kind = KINDS[spec.modality]
                writer.add(
                    sample_of(spec, f"{kind}-{spec.index:06d}", text, rate),
                    None if media is None else encode_media(kind, media, rate),
                )
                done += 1
                if progress is not None:
                    progress(done, num)
        writer.close()
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir / MANIFEST if fmt == "jsonl" else out_dir


def ensure_dataset(recipe: Recipe) -> str:
    """Location of the recipe's dataset ("dynamic" for on-the-fly data), generating a synthetic one on first use.

    A synthetic dataset generated from other settings is regenerated; data without a generator fingerprint is
    someone's real data and is used as it is."""
    location = dataset_location(recipe)
    if location is not None:
        return location
    root = Path(recipe.data_dir())
    if (root / FINGERPRINT).is_file():
        log.warning("%s was generated from other settings; regenerating it", root)
    elif root.is_file() or (root.is_dir() and any(root.iterdir())):
        # Generating publishes over the location: never over data omni did not write.
        raise ValueError(
            f"data.path {root} holds data omni did not generate, and data.source is 'synthetic', which would "
            "replace it: set data.source to 'jsonl' or 'wds' to read it, or choose another data.path"
        )
    return str(generate_dataset(recipe, root))
