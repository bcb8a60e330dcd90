"""Held-out evaluation of a checkpoint: loss and perplexity, total and per modality."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from omni_core.data.batch import MODALITY_IDS
from omni_core.data.dataset import ManifestDataset
from omni_core.data.loader import PackedLoader
from omni_core.data.synthetic import ensure_dataset
from omni_core.models.omni import build_model
from omni_core.recipe.schema import Recipe
from omni_core.results import EvalReport, ModalityScore
from omni_core.runtime.checkpoint import latest_checkpoint, load_checkpoint
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.loss import summarize, token_loss_sums


def evaluate(recipe: Recipe, checkpoint: str | Path | None = None) -> EvalReport:
    """Evaluate `checkpoint` (default: the newest complete one of the recipe) on the held-out split."""
    ckpt = Path(checkpoint) if checkpoint else latest_checkpoint(Path(recipe.checkpoint_dir()))
    if ckpt is None:
        raise FileNotFoundError(f"no complete checkpoint in {recipe.checkpoint_dir()} (train first)")
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = build_model(
        recipe.model.flavor, patch_size=recipe.data.patch_size, n_mels=recipe.data.n_mels,
        seed=recipe.experiment.seed,
    )
    manifest, _ = load_checkpoint(ckpt, model=model, optimizer=None, scheduler=None, info=info)
    model.eval()

    dataset = ManifestDataset(ensure_dataset(recipe), recipe.data)
    loader = PackedLoader(dataset, recipe.data, "heldout", 0, 1, recipe.experiment.seed)
    stats = None
    samples = 0
    with torch.no_grad():
        for index, batch in enumerate(loader):
            if index >= recipe.eval.max_batches:
                break
            sums = token_loss_sums(model(batch), batch).stats()
            stats = sums if stats is None else stats + sums
            samples += batch.num_samples
    if stats is None:
        raise ValueError(f"held-out split of {dataset} is empty: raise data.heldout_fraction")

    counts = stats[1 + len(MODALITY_IDS):]
    means = summarize(stats)
    per_modality = {
        name: ModalityScore(loss=means[f"loss/{name}"], perplexity=math.exp(means[f"loss/{name}"]),
                            tokens=int(counts[idx]))
        for name, idx in MODALITY_IDS.items()
        if f"loss/{name}" in means
    }
    return EvalReport(
        checkpoint=str(ckpt), step=manifest.step, samples=samples, loss=means["loss"],
        perplexity=math.exp(means["loss"]), per_modality=per_modality,
    )
