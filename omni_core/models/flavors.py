"""Flavor registry: named architecture sizes. Adding a flavor is adding one entry to FLAVORS."""

from __future__ import annotations

from dataclasses import replace

from omni_core.models.args import AudioArgs, LLMArgs, OmniModelArgs, VisionArgs

FLAVORS: dict[str, OmniModelArgs] = {
    # ~1.1M parameters: trains a few hundred steps per minute on one CPU core at seq 512.
    "debug": OmniModelArgs(
        llm=LLMArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384),
        vision=VisionArgs(dim=64, n_layers=2, n_heads=4, max_grid=64),
        audio=AudioArgs(dim=64, n_layers=2, n_heads=4),
    ),
}


def get_flavor(name: str, *, patch_size: int, n_mels: int) -> OmniModelArgs:
    """The flavor's architecture with its input widths taken from the data recipe (patch size, mel bins)."""
    if name not in FLAVORS:
        raise ValueError(f"unknown model flavor {name!r}; known flavors: {', '.join(sorted(FLAVORS))}")
    args = FLAVORS[name]
    return replace(
        args,
        vision=replace(args.vision, patch_dim=3 * patch_size * patch_size),
        audio=replace(args.audio, n_mels=n_mels),
    )
