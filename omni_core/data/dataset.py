"""A JSONL manifest as a random-access dataset: metadata (token counts, split) up front, files decoded only
on demand, and every failure to decode surfaced as one exception type the loader can count and skip."""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, TypeVar

import torch

from omni_core.data.audio import log_mel, read_audio, resample
from omni_core.data.image import load_image, patchify
from omni_core.data.sample import Sample, Segment, sample_tokens, token_ids
from omni_core.data.tokenizer import PAD_ID
from omni_core.recipe.schema import DataConfig

MANIFEST = "manifest.jsonl"
Split = Literal["train", "heldout"]
T = TypeVar("T")


class CorruptSample(Exception):
    """A sample whose file is missing, unreadable, or disagrees with its manifest metadata.

    `reason` is one of "missing_file", "unreadable_file", "size_mismatch" and is what loaders count."""

    def __init__(self, sample_id: str, path: Path, reason: str, detail: str = "") -> None:
        super().__init__(f"sample {sample_id!r}: {path}: {reason}{': ' + detail if detail else ''}")
        self.sample_id, self.path, self.reason = sample_id, path, reason


@dataclass
class DecodedSample:
    """One document of a packed sequence: input ids plus the encoder inputs its placeholders stand for."""

    input_ids: list[int]
    modality: str = "text"
    image_patches: list[torch.Tensor] = field(default_factory=list)  # [rows*cols, 3*p*p] each
    image_grids: list[tuple[int, int]] = field(default_factory=list)
    audio_mels: list[torch.Tensor] = field(default_factory=list)  # [frames, n_mels] each
    is_padding: bool = False

    @classmethod
    def padding(cls, length: int) -> DecodedSample:
        return cls([PAD_ID] * length, is_padding=True)


def in_heldout(sample_id: str, fraction: float) -> bool:
    """Split by a hash of the id, so a sample stays on its side when the manifest is reordered or grows."""
    digest = hashlib.sha256(sample_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


class ManifestDataset:
    def __init__(self, manifest_path: str | Path, data_cfg: DataConfig) -> None:
        self.manifest_path = Path(manifest_path)
        self.root = self.manifest_path.parent
        self.cfg = data_cfg
        if not self.manifest_path.is_file():
            raise FileNotFoundError(f"dataset manifest not found: {self.manifest_path}")
        self.samples: list[Sample] = []
        self.bad_lines: list[tuple[int, str]] = []  # (1-based line number, why it was skipped)
        self._read_manifest()
        self.token_counts = [sample_tokens(s, data_cfg) for s in self.samples]
        heldout = [in_heldout(s.id, data_cfg.heldout_fraction) for s in self.samples]
        self.splits: dict[str, list[int]] = {
            "train": [i for i, h in enumerate(heldout) if not h],
            "heldout": [i for i, h in enumerate(heldout) if h],
        }

    def _read_manifest(self) -> None:
        seen: set[str] = set()
        with self.manifest_path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    sample = Sample.from_json(json.loads(line))
                except ValueError as err:  # json.JSONDecodeError is a ValueError too
                    self.bad_lines.append((number, str(err)))
                    continue
                if sample.id in seen:
                    self.bad_lines.append((number, f"duplicate id {sample.id!r}"))
                    continue
                seen.add(sample.id)
                self.samples.append(sample)
        if self.bad_lines:
            shown = "; ".join(f"line {n}: {why}" for n, why in self.bad_lines[:10])
            more = f" (and {len(self.bad_lines) - 10} more)" if len(self.bad_lines) > 10 else ""
            warnings.warn(f"{self.manifest_path}: skipped {len(self.bad_lines)} bad lines: {shown}{more}", stacklevel=3)

    def __len__(self) -> int:
        return len(self.samples)

    def token_count(self, i: int) -> int:
        return self.token_counts[i]

    def decode(self, i: int) -> DecodedSample:
        """Reads and featurises sample i's files; raises CorruptSample instead of any I/O or format error."""
        sample, cfg = self.samples[i], self.cfg
        doc = DecodedSample(token_ids(sample, cfg), sample.modality)
        for seg in sample.segments:
            if seg.kind == "image":
                img = self._open(sample, seg, load_image)
                self._check(sample, seg, f"{img.width}x{img.height}", f"{seg.width}x{seg.height}")
                patches, grid = patchify(img, cfg.patch_size, cfg.max_image_patches)
                doc.image_patches.append(patches)
                doc.image_grids.append(grid)
            elif seg.kind == "audio":
                wave, rate = self._open(sample, seg, read_audio)
                self._check(sample, seg, f"{len(wave)} samples at {rate} Hz",
                            f"{seg.num_samples} samples at {seg.sample_rate} Hz")
                doc.audio_mels.append(log_mel(resample(wave, rate, cfg.sample_rate), cfg.sample_rate, cfg.n_mels))
        return doc

    def _open(self, sample: Sample, seg: Segment, reader: Callable[[Path], T]) -> T:
        path = self.root / seg.path
        if not path.is_file():
            raise CorruptSample(sample.id, path, "missing_file")
        try:
            return reader(path)
        except (OSError, RuntimeError, ValueError) as err:  # what PIL and libsndfile raise for bad bytes
            raise CorruptSample(sample.id, path, "unreadable_file", str(err)) from err

    def _check(self, sample: Sample, seg: Segment, actual: str, expected: str) -> None:
        """The packer trusted the manifest's sizes; a file that disagrees would break the placeholder count."""
        if actual != expected:
            detail = f"file has {actual}, manifest says {expected}"
            raise CorruptSample(sample.id, self.root / seg.path, "size_mismatch", detail)
