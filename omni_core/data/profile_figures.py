"""The profile's figures: token-length histograms per modality, modality shares, the mix over time, drift
per window and sequence fill, drawn from a `DatasetProfile` into PNG files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from omni_core.data.profile_result import DatasetProfile


def _save(fig: Figure, path: Path) -> Path:
    """Agg canvas on a bare Figure: no pyplot, so no global backend switch and no figure registry to leak."""
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def figures(profile: DatasetProfile, out_dir: Path) -> list[Path]:
    """Length histograms per modality, modality shares, mix over time, drift per window, sequence fill."""
    names = list(profile.modalities)
    lengths = Figure(figsize=(4 * len(names), 3))
    for ax, name in zip(lengths.subplots(1, len(names), squeeze=False)[0], names):
        mod = profile.modalities[name]
        ax.stairs(mod.hist_counts, mod.hist_edges, fill=True)
        ax.set(title=f"{name} (n={mod.count})", xlabel="tokens per sample", ylabel="samples")
        if max(mod.hist_counts) > 100 * min(c for c in mod.hist_counts if c):
            ax.set_yscale("log")  # a long tail (long documents) would not show on a linear scale

    shares = Figure(figsize=(4, 3))
    ax = shares.subplots()
    x = np.arange(len(names))
    ax.bar(x - 0.2, [profile.modalities[n].share for n in names], width=0.4, label="samples")
    ax.bar(x + 0.2, [profile.modalities[n].tokens / profile.total_tokens for n in names], width=0.4, label="tokens")
    ax.set(title="modality shares", ylabel="share", xticks=x, xticklabels=names)
    ax.legend()

    starts = [w.start for w in profile.windows]
    mix = Figure(figsize=(6, 3))
    ax = mix.subplots()
    ax.stackplot(starts, [[w.shares.get(n, 0.0) for w in profile.windows] for n in names], labels=names, step="post")
    ax.set(title=f"mix over time (windows of {profile.window})", xlabel="sample", ylabel="share", ylim=(0, 1))
    ax.legend(loc="upper right", fontsize="small")

    drift = Figure(figsize=(6, 3))
    ax = drift.subplots()
    ax.plot(starts, [w.ks for w in profile.windows], marker=".", label="KS, all lengths")
    ax.plot(
        starts,
        [max(w.ks_by_modality.values(), default=0.0) for w in profile.windows],
        marker=".",
        label="KS, worst modality",
    )
    ax.plot(starts, [w.mix_distance for w in profile.windows], marker=".", label="mix distance")
    ax.axhline(profile.drift_threshold, color="red", linestyle="--", label="threshold")
    for w in profile.windows:
        if w.drift:
            ax.axvspan(w.start, w.start + w.count, color="red", alpha=0.1)
    ax.set(title="drift against the first window", xlabel="sample", ylim=(0, 1))
    ax.legend(loc="upper left", fontsize="small")

    packing = Figure(figsize=(4, 3))
    ax = packing.subplots()
    seqs = profile.sequences
    ax.bar(["real", "padding"], [seqs.real_tokens_mean, seqs.padding_mean])
    ax.set(
        title=f"packing efficiency {profile.packing_efficiency:.3f} ({seqs.count} sequences)",
        ylabel=f"tokens per sequence (of {seqs.capacity})",
    )
    return [
        _save(lengths, out_dir / "token_lengths.png"),
        _save(shares, out_dir / "modality_shares.png"),
        _save(mix, out_dir / "mix_over_time.png"),
        _save(drift, out_dir / "drift.png"),
        _save(packing, out_dir / "packing.png"),
    ]
