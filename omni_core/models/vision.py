"""ViT over native-resolution patch grids: images keep their aspect ratio, each is one attention document.
Videos are frames through the same encoder, with consecutive frames merged afterwards."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_core.models.args import VisionArgs
from omni_core.models.attention import EncoderBlock, EncoderShard
from omni_core.models.shapes import Shapes, host_rows


class VisionEncoder(nn.Module):
    """Patches [P, patch_dim] of N images (row-major, image after image) -> embeddings [P, dim].

    A patch is flattened as (channel, y, x), so `patch_embed` is a Conv2d(kernel=stride=patch) patch embedding.
    """

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = nn.Linear(args.patch_dim, args.dim)
        if args.pos_embed == "factorized":
            # Row + col tables: any grid up to max_grid x max_grid without interpolation.
            self.row_embed = nn.Embedding(args.max_grid, args.dim)
            self.col_embed = nn.Embedding(args.max_grid, args.dim)
        else:
            self.pos_embed = nn.Embedding(args.max_grid * args.max_grid, args.dim)
        self.layers = nn.ModuleList(
            EncoderBlock(args.dim, args.n_heads, args.mlp_ratio, args.norm_eps, args.activation)
            for _ in range(args.n_layers)
        )
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)

    def positions(self, rows: int, cols: int) -> torch.Tensor:
        """[rows * cols, dim] position embeddings of one grid, row-major."""
        if self.args.pos_embed == "factorized":
            device = self.row_embed.weight.device
            r = torch.arange(rows, device=device).repeat_interleave(cols)
            c = torch.arange(cols, device=device).repeat(rows)
            return self.row_embed(r) + self.col_embed(c)
        table = self.pos_embed.weight
        side = self.args.max_grid
        if (rows, cols) == (side, side):
            return table
        # Bicubic, like SiglipVisionEmbeddings.interpolate_pos_encoding, so resampled grids match it too.
        grid = table.view(1, side, side, -1).permute(0, 3, 1, 2)
        resized = F.interpolate(grid.float(), size=(rows, cols), mode="bicubic", align_corners=False)
        return resized[0].permute(1, 2, 0).reshape(rows * cols, -1).to(table.dtype)

    def forward(self, patches: torch.Tensor, grids: Shapes, shard: EncoderShard | None = None) -> torch.Tensor:
        """Patches [P, patch_dim] of the images in `grids` [N, 2] (rows, cols: host ints, or a tensor) -> [P, dim].

        With `shard` (long-short sequence parallelism), `grids` is ONE image [1, 2] and `patches` only this
        member's row-major patches `shard.offset .. offset + length` of it: positions are sliced to them, the
        attention runs over the whole image through the shard, and the result is this member's [length, dim].
        The caller aligns chunks to whole merge rows, so that the projector's spatial merge stays local.
        """
        x, cu_seqlens = self.embed(patches, grids, shard)
        for layer in self.layers:
            x = layer(x, cu_seqlens, shard)
        return self.norm(x) if self.args.final_norm else x

    def embed(
        self, patches: torch.Tensor, grids: Shapes, shard: EncoderShard | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """`forward`'s stem: the blocks' input (patch embeddings plus positions) and its documents' bounds."""
        grid_list = host_rows(grids)
        patch_counts = [rows * cols for rows, cols in grid_list]
        if shard is None:
            covered, expected = "image grids cover", sum(patch_counts)
        elif len(grid_list) != 1:
            raise ValueError(f"a sequence shard splits one image, got {len(grid_list)} grids: {grid_list}")
        elif shard.offset + shard.length > patch_counts[0]:
            raise ValueError(
                f"shard patches {shard.offset}..{shard.offset + shard.length} exceed the image's "
                f"{patch_counts[0]} patches (grid {grid_list[0]})"
            )
        else:
            covered, expected = "the shard holds", shard.length
        if expected != patches.shape[0]:
            raise ValueError(f"{covered} {expected} patches, but {patches.shape[0]} were given")
        if self.args.pos_embed == "factorized" and grid_list and max(max(g) for g in grid_list) > self.args.max_grid:
            raise ValueError(f"an image grid exceeds max_grid={self.args.max_grid}: {grid_list}")
        pos = torch.cat([self.positions(rows, cols) for rows, cols in grid_list])
        if shard is None:
            cu_seqlens = [0]
            for count in patch_counts:
                cu_seqlens.append(cu_seqlens[-1] + count)
        else:
            pos, cu_seqlens = pos[shard.offset : shard.offset + shard.length], [0, shard.length]
        return self.patch_embed(patches.to(self.patch_embed.weight.dtype)) + pos, cu_seqlens

    def forward_video(self, patches: torch.Tensor, video_grids: Shapes, temporal_merge: int) -> torch.Tensor:
        """Patches of N videos, frame after frame, with `video_grids` [N, 3] (frames, rows, cols) ->
        [sum(ceil(frames / temporal_merge) * rows * cols), dim].

        Each frame is its own attention document (cost linear in the frame count); then every
        `temporal_merge` consecutive frames are averaged position-wise (the last group may be shorter).
        """
        return self.merge_frames(self(patches, self.frame_grids(video_grids)), video_grids, temporal_merge)

    @staticmethod
    def frame_grids(video_grids: Shapes) -> list[tuple[int, int]]:
        """Each frame of the videos in `video_grids` [N, 3] as an image grid (rows, cols)."""
        return [(r, c) for f, r, c in host_rows(video_grids) for _ in range(f)]

    @staticmethod
    def merge_frames(features: torch.Tensor, video_grids: Shapes, temporal_merge: int) -> torch.Tensor:
        """Frame features of the videos in `video_grids`, every `temporal_merge` consecutive frames averaged
        position-wise (`forward_video`)."""
        videos = host_rows(video_grids)
        merged: list[torch.Tensor] = []
        for (frames, rows, cols), clip in zip(videos, features.split([f * r * c for f, r, c in videos])):
            merged.extend(group.mean(dim=0) for group in clip.view(frames, rows * cols, -1).split(temporal_merge))
        return torch.cat(merged) if merged else features
