"""Projector: maps an encoder's embeddings into the LLM's embedding space."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Projector(nn.Module):
    """Two-layer GELU MLP, encoder dim -> hidden -> LLM dim (LLaVA-style)."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))
