"""Projectors: map an encoder's embeddings into the LLM's embedding space (LLaVA's two-layer MLP, or Qwen2-Audio's
one Linear), optionally merging image tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_core.models.flops import merged_grid
from omni_core.models.shapes import Shapes, host_rows


def spatial_merge(x: torch.Tensor, grids: Shapes, merge: int) -> torch.Tensor:
    """[P, dim] row-major patch features of N images -> [sum of merged tokens, merge*merge*dim]: each
    merge x merge window concatenated (Qwen2-VL / InternVL pixel shuffle); edge windows are zero-padded."""
    if merge == 1:
        return x
    grid_list = host_rows(grids)
    out = []
    for (rows, cols), image in zip(grid_list, x.split([r * c for r, c in grid_list])):
        m_rows, m_cols = merged_grid(rows, cols, merge)
        image = image.view(rows, cols, -1).permute(2, 0, 1)
        image = F.pad(image, (0, m_cols * merge - cols, 0, m_rows * merge - rows))
        windows = image.view(-1, m_rows, merge, m_cols, merge).permute(1, 3, 2, 4, 0)
        out.append(windows.reshape(m_rows * m_cols, -1))
    return torch.cat(out)


class Projector(nn.Module):
    """Two-layer GELU MLP, encoder dim -> hidden -> LLM dim (LLaVA-style)."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class LinearProjector(nn.Module):
    """One Linear with bias, encoder dim -> LLM dim: Qwen2-Audio's multi_modal_projector."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def make_projector(in_dim: int, hidden: int, out_dim: int) -> Projector | LinearProjector:
    """The projector of `flops.projector_dims`'s (in, hidden, out): hidden 0 is one Linear, no hidden layer."""
    return LinearProjector(in_dim, out_dim) if hidden == 0 else Projector(in_dim, hidden, out_dim)
