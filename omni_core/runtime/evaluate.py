"""Held-out evaluation of a checkpoint: loss and perplexity, total and per modality, and the task metric
(greedy captions and transcripts scored word by word, see `generate`)."""

from __future__ import annotations

import math

import torch

from omni_core.common.batch import MODALITY_IDS, video_tokens
from omni_core.common.loss import summarize, token_loss_sums
from omni_core.common.results import EvalReport, ModalityScore, TaskScore
from omni_core.common.tokenizer import tokenizer_for
from omni_core.data.dataset import open_dataset
from omni_core.data.loader import PackedLoader
from omni_core.models.flops import merged_grid
from omni_core.models.omni import OmniModel
from omni_core.recipe.schema import Recipe
from omni_core.runtime.checkpoint import Manifest, latest_checkpoint, load_checkpoint
from omni_core.runtime.ckpt_store import CheckpointError, checkpoint_cache, checkpoint_store
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.generate import (
    Document,
    answer_documents,
    answer_exact_match,
    answer_token_f1,
    documents,
    word_accuracy,
)
from omni_core.runtime.model_init import unfilled_model


def evaluate_checkpoint(recipe: Recipe, checkpoint: str | None = None) -> EvalReport:
    """Evaluate `checkpoint` (a location; default: the recipe's newest complete one) on the held-out split."""
    ckpt = checkpoint or latest_checkpoint(checkpoint_store(recipe))
    if ckpt is None:
        raise CheckpointError(f"no complete checkpoint in {recipe.checkpoint_dir()} (train first)")
    model, manifest = load_model(recipe, ckpt)
    model.to(eval_device(recipe))
    dataset = open_dataset(recipe)
    loader = PackedLoader(dataset, recipe.data, "heldout", 0, 1, recipe.experiment.seed)
    stats, samples, captions = heldout_pass(recipe, model, loader)
    if stats is None:
        raise ValueError(f"held-out split of {dataset} is empty: raise data.heldout_fraction")
    means = summarize(stats.tolist())
    return EvalReport(
        checkpoint=str(ckpt),
        step=manifest.step,
        samples=samples,
        loss=means["loss"],
        perplexity=math.exp(means["loss"]),
        per_modality=modality_scores(stats, means),
        task=task_scores(captions),
    )


def load_model(recipe: Recipe, ckpt: str) -> tuple[OmniModel, Manifest]:
    """The recipe's whole model on this process's CPU, its weights restored from `ckpt`, in eval mode."""
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = unfilled_model(recipe, info.device)  # pretrained parts' architectures included
    manifest, _ = load_checkpoint(ckpt, cache=checkpoint_cache(recipe), parts=[model], optimizers=None, info=info)
    model.eval()
    return model, manifest


def eval_device(recipe: Recipe) -> torch.device:
    """`eval.device`; auto: the GPU where there is one (training ran there), else the CPU."""
    wanted = recipe.eval.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ValueError("eval.device=cuda: this machine has no CUDA device")
    return torch.device(wanted)


Captions = dict[str, list[tuple[str, str]]]  # modality -> (decoded, reference) pairs


def heldout_pass(recipe: Recipe, model: OmniModel, loader: PackedLoader) -> tuple[torch.Tensor | None, int, Captions]:
    """One pass over up to `eval.max_batches` held-out batches: the summed loss statistics (None for no batch),
    the samples seen, and up to `eval.generate_samples` greedy captions per modality with their references."""

    def tokens_per_image(rows: int, cols: int) -> int:
        return math.prod(merged_grid(rows, cols, model.args.spatial_merge))

    def tokens_per_video(frames: int, rows: int, cols: int) -> int:
        return video_tokens(frames, rows, cols, model.args.temporal_merge, model.args.spatial_merge)

    tokenizer = tokenizer_for(recipe)
    device = next(model.parameters()).device
    stats = None
    samples = 0
    prompts: dict[str, list[Document]] = {}
    with torch.no_grad():
        for index, batch in enumerate(loader):
            if index >= recipe.eval.max_batches:
                break
            on_device = batch.to(device)
            sums = token_loss_sums(model(on_device), on_device).stats().cpu()
            stats = sums if stats is None else stats + sums
            samples += batch.num_samples
            for doc in documents(batch, tokenizer, tokens_per_image, tokens_per_video, model.args.audio.pool):
                chosen = prompts.setdefault(doc.modality, [])
                if len(chosen) < recipe.eval.generate_samples:
                    chosen.append(doc)
    ev = recipe.eval
    captions = {
        modality: answer_documents(model, docs, tokenizer, ev.max_new_tokens, recipe.data.seq_len, ev.batch_size)
        for modality, docs in prompts.items()
    }
    return stats, samples, captions


def modality_scores(stats: torch.Tensor, means: dict[str, float]) -> dict[str, ModalityScore]:
    """Loss, perplexity and target tokens of each modality the held-out targets hold."""
    counts = stats[1 + len(MODALITY_IDS) :]
    return {
        name: ModalityScore(
            loss=means[f"loss/{name}"], perplexity=math.exp(means[f"loss/{name}"]), tokens=int(counts[idx])
        )
        for name, idx in MODALITY_IDS.items()
        if f"loss/{name}" in means
    }


def task_scores(captions: Captions) -> dict[str, TaskScore]:
    """Word accuracy, exact matches (as decoded, and normalised) and token F1 of each modality's greedy
    answers against their references."""
    return {
        modality: TaskScore(
            samples=len(pairs),
            word_accuracy=sum(word_accuracy(*pair) for pair in pairs) / len(pairs),
            exact_match=sum(decoded == reference for decoded, reference in pairs) / len(pairs),
            answer_exact_match=sum(answer_exact_match(*pair) for pair in pairs) / len(pairs),
            answer_token_f1=sum(answer_token_f1(*pair) for pair in pairs) / len(pairs),
            examples=pairs[:3],
        )
        for modality, pairs in captions.items()
        if pairs
    }
