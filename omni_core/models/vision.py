"""ViT over native-resolution patch grids: images keep their aspect ratio, each is one attention document."""

from __future__ import annotations

import torch
from torch import nn

from omni_core.models.args import VisionArgs
from omni_core.models.attention import EncoderBlock


class VisionEncoder(nn.Module):
    """Patches [P, patch_dim] of N images (row-major, image after image) -> embeddings [P, dim]."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = nn.Linear(args.patch_dim, args.dim)
        # Factorised 2D positions (row + col): any grid up to max_grid x max_grid without interpolation.
        self.row_embed = nn.Embedding(args.max_grid, args.dim)
        self.col_embed = nn.Embedding(args.max_grid, args.dim)
        self.layers = nn.ModuleList(EncoderBlock(args.dim, args.n_heads, args.mlp_ratio) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)

    def forward(self, patches: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        grid_list = grids.tolist()
        patch_counts = [rows * cols for rows, cols in grid_list]
        if sum(patch_counts) != patches.shape[0]:
            raise ValueError(f"image grids cover {sum(patch_counts)} patches, but {patches.shape[0]} were given")
        if grid_list and max(max(grid) for grid in grid_list) > self.args.max_grid:
            raise ValueError(f"an image grid exceeds max_grid={self.args.max_grid}: {grid_list}")
        rows = torch.cat([torch.arange(r, device=patches.device).repeat_interleave(c) for r, c in grid_list])
        cols = torch.cat([torch.arange(c, device=patches.device).repeat(r) for r, c in grid_list])
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype)) + self.row_embed(rows) + self.col_embed(cols)
        cu_seqlens = [0]
        for count in patch_counts:
            cu_seqlens.append(cu_seqlens[-1] + count)
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return self.norm(x)
