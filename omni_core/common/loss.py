"""Token losses as sums, so that ranks and micro-batches combine into the exact global token mean."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from omni_core.common.batch import MODALITY_IDS, PackedBatch

IGNORE = -100
STATS_SIZE = 1 + 2 * len(MODALITY_IDS)  # length of `LossSums.stats()`


@dataclass
class LossSums:
    """Summed cross-entropy and target counts, total and per modality (indexed by MODALITY_IDS)."""

    total: torch.Tensor  # scalar, differentiable
    per_modality: torch.Tensor  # [M] detached sums
    counts: torch.Tensor  # [M] target counts

    def stats(self) -> torch.Tensor:
        """[loss_sum, sums..., counts...] in one float64 tensor on the loss's device, for a single all-reduce."""
        return torch.cat([self.total.detach().reshape(1), self.per_modality, self.counts]).double()


def token_loss_sums(logits: torch.Tensor, batch: PackedBatch) -> LossSums:
    per_token = F.cross_entropy(logits.float(), batch.labels, ignore_index=IGNORE, reduction="none")
    mask = batch.labels != IGNORE
    modality = batch.loss_modality.masked_fill(~mask, 0)
    num_modalities = len(MODALITY_IDS)
    sums = torch.zeros(num_modalities, dtype=torch.float32, device=logits.device)
    sums.index_add_(0, modality, (per_token * mask).detach().float())
    counts = torch.zeros(num_modalities, dtype=torch.float32, device=logits.device)
    counts.index_add_(0, modality, mask.float())
    return LossSums(total=(per_token * mask).sum(), per_modality=sums, counts=counts)


def summarize(stats: Sequence[float]) -> dict[str, float]:
    """Turn all-reduced `LossSums.stats()`, read to the host, into mean losses: `loss` and `loss/<modality>`."""
    num_modalities = len(MODALITY_IDS)
    sums, counts = stats[1 : 1 + num_modalities], stats[1 + num_modalities :]
    out = {"loss": stats[0] / max(sum(counts), 1.0)}
    for name, idx in MODALITY_IDS.items():
        if counts[idx] > 0:
            out[f"loss/{name}"] = sums[idx] / counts[idx]
    return out


def local_targets(batch: PackedBatch, token_index: torch.Tensor | None) -> PackedBatch:
    """The batch with its targets cut to the tokens this rank's LLM holds (context parallelism)."""
    if token_index is None:
        return batch
    return replace(batch, labels=batch.labels[token_index], loss_modality=batch.loss_modality[token_index])
