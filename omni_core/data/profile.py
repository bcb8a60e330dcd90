"""The profile stage: what is in the data (modality mix, token lengths, packing efficiency), from manifest
metadata only, as a typed `DatasetProfile` plus figures."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from omni_core.data.dataset import ManifestDataset
from omni_core.data.loader import epoch_order
from omni_core.data.packing import pack_sequences
from omni_core.data.sample import segment_tokens
from omni_core.data.synthetic import ensure_dataset
from omni_core.recipe.schema import Recipe
from omni_core.results import Result

HIST_BINS = 20


class ModalityProfile(Result):
    count: int
    share: float  # of profiled samples
    tokens: int  # LLM tokens, placeholders included
    encoder_tokens_mean: float  # image patches / audio embeddings per sample: the encoders' share of the work
    mean: float
    p50: float
    p90: float
    p99: float
    max: int
    hist_edges: list[float]
    hist_counts: list[int]


class DatasetProfile(Result):
    manifest: str
    manifest_samples: int  # valid samples in the manifest
    total_samples: int  # samples profiled (<= manifest_samples when data.profile_max_samples caps it)
    total_tokens: int
    seq_len: int
    modalities: dict[str, ModalityProfile]
    skipped: dict[str, int]  # reason -> count: "bad_line" (manifest), "too_long" (> seq_len)
    packed_sequences: int  # the profiled train samples, packed as the loader's first epoch on one rank
    packing_efficiency: float  # real tokens / (packed_sequences * seq_len)


def _modality_profile(lengths: np.ndarray, encoder_tokens: np.ndarray, total: int) -> ModalityProfile:
    lo, hi = int(lengths.min()), int(lengths.max())
    width = math.ceil((hi - lo + 1) / HIST_BINS)  # whole tokens per bin, so no bin is empty by rounding
    counts, edges = np.histogram(lengths, bins=np.arange(lo, hi + width + 1, width))
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return ModalityProfile(
        count=len(lengths),
        share=len(lengths) / total,
        tokens=int(lengths.sum()),
        encoder_tokens_mean=float(encoder_tokens.mean()),
        mean=float(lengths.mean()),
        p50=float(p50),
        p90=float(p90),
        p99=float(p99),
        max=int(lengths.max()),
        hist_edges=edges.tolist(),
        hist_counts=counts.tolist(),
    )


def _save(fig: Figure, path: Path) -> Path:
    """Agg canvas on a bare Figure: no pyplot, so no global backend switch and no figure registry to leak."""
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _figures(profile: DatasetProfile, out_dir: Path) -> list[Path]:
    names = list(profile.modalities)
    lengths = Figure(figsize=(4 * len(names), 3))
    for ax, name in zip(lengths.subplots(1, len(names), squeeze=False)[0], names):
        mod = profile.modalities[name]
        ax.stairs(mod.hist_counts, mod.hist_edges, fill=True)
        ax.set(title=f"{name} (n={mod.count})", xlabel="tokens per sample", ylabel="samples")

    shares = Figure(figsize=(4, 3))
    ax = shares.subplots()
    x = np.arange(len(names))
    ax.bar(x - 0.2, [profile.modalities[n].share for n in names], width=0.4, label="samples")
    ax.bar(x + 0.2, [profile.modalities[n].tokens / profile.total_tokens for n in names], width=0.4, label="tokens")
    ax.set(title="modality shares", ylabel="share", xticks=x, xticklabels=names)
    ax.legend()
    return [_save(lengths, out_dir / "token_lengths.png"), _save(shares, out_dir / "modality_shares.png")]


def profile_dataset(recipe: Recipe, out_dir: Path) -> tuple[DatasetProfile, list[Path]]:
    """Profiles the recipe's dataset (generated first if synthetic) into out_dir/profile.json and figures.

    With data.profile_max_samples > 0, a seeded random subset of that size stands for the whole manifest."""
    cfg = recipe.data
    dataset = ManifestDataset(ensure_dataset(recipe), cfg)
    if not len(dataset):
        raise ValueError(f"{dataset.manifest_path} holds no valid sample to profile")
    indices = np.arange(len(dataset))
    if 0 < cfg.profile_max_samples < len(dataset):
        rng = np.random.default_rng(recipe.experiment.seed)
        indices = np.sort(rng.choice(len(dataset), size=cfg.profile_max_samples, replace=False))
    lengths = np.array([dataset.token_count(i) for i in indices], dtype=np.int64)
    encoder = np.array(
        [sum(segment_tokens(s, cfg) for s in dataset.samples[i].segments if s.kind != "text") for i in indices]
    )
    modality = np.array([dataset.samples[i].modality for i in indices])
    fits = lengths <= cfg.seq_len
    train = set(dataset.splits["train"])
    packable = epoch_order([int(i) for i, ok in zip(indices, fits) if ok and i in train], recipe.experiment.seed, 0)
    packed_tokens = sum(dataset.token_count(i) for i in packable)
    sequences = len(pack_sequences(((i, dataset.token_count(i)) for i in packable), cfg.seq_len))
    skipped = {"bad_line": len(dataset.bad_lines), "too_long": int((~fits).sum())}
    profile = DatasetProfile(
        manifest=str(dataset.manifest_path),
        manifest_samples=len(dataset),
        total_samples=len(indices),
        total_tokens=int(lengths.sum()),
        seq_len=cfg.seq_len,
        modalities={
            m: _modality_profile(lengths[modality == m], encoder[modality == m], len(indices))
            for m in sorted(set(modality.tolist()))
        },
        skipped={reason: count for reason, count in skipped.items() if count},
        packed_sequences=sequences,
        packing_efficiency=packed_tokens / (sequences * cfg.seq_len) if sequences else 0.0,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    profile.save(out_dir / "profile.json")
    return profile, _figures(profile, out_dir)
