"""Whisper-style audio encoder: conv subsampling of log-mel frames, sinusoidal positions, transformer blocks."""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from omni_core.common.batch import audio_tokens
from omni_core.models.args import AudioArgs
from omni_core.models.attention import EncoderBlock, EncoderShard
from omni_core.models.shapes import Counts, host_ints


def sinusoids(positions: torch.Tensor, dim: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's fixed positional table [len(positions), dim]: sin half then cos half. Computed, not stored."""
    log_increment = math.log(max_timescale) / (dim // 2 - 1)
    inv_timescales = torch.exp(-log_increment * torch.arange(dim // 2, device=positions.device, dtype=torch.float32))
    scaled = positions.to(torch.float32)[:, None] * inv_timescales[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


class AudioEncoder(nn.Module):
    """Log-mel frames [F, n_mels] of N clips (clip after clip) -> embeddings [sum(audio_tokens(frames, pool)), dim].

    Whisper's subsampling (conv1 stride 1, conv2 stride 2), but clips of any even length rather than a fixed
    30 s window: each clip is its own attention document, positions restart at 0 per clip. With `args.pool`
    (Qwen2-Audio's avg_pooler) every `pool` neighbouring outputs of the blocks are averaged per clip before
    the final norm (`finish`).
    """

    def __init__(self, args: AudioArgs):
        super().__init__()
        self.args = args
        self.conv1 = nn.Conv1d(args.n_mels, args.dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(args.dim, args.dim, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(
            EncoderBlock(args.dim, args.n_heads, args.mlp_ratio, args.norm_eps, args.activation)
            for _ in range(args.n_layers)
        )
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)

    def subsample(self, clip: torch.Tensor) -> torch.Tensor:
        """One clip [frames, n_mels] -> [frames // 2, dim]. Per clip, so the convs never mix two clips."""
        x = F.gelu(self.conv1(clip.T.unsqueeze(0)))
        return F.gelu(self.conv2(x)).squeeze(0).T

    def forward(self, mels: torch.Tensor, frames: Counts, shard: EncoderShard | None = None) -> torch.Tensor:
        """Mel frames [F, n_mels] of the clips in `frames` [N] (host ints, or a tensor) -> their embeddings
        [sum(audio_tokens(frames, pool)), dim].

        With `shard` (long-short sequence parallelism), `frames` is ONE clip [1] and `mels` the WHOLE clip:
        the conv stem needs each chunk's neighbouring frames, and is cheap, so every member runs it on the
        whole clip (redundantly) and keeps its subsampled tokens `shard.offset .. offset + length`; only the
        transformer blocks are split, their attention running over the whole clip through the shard. Returns
        this member's [length // pool, dim] (the caller aligns chunks to the pool, `encoder_items.audio_splits`);
        the stem's parameter gradients then sum over the members.
        """
        x, cu_seqlens = self.embed(mels, frames, shard)
        for layer in self.layers:
            x = layer(x, cu_seqlens, shard)
        return self.finish(x, cu_seqlens)

    def finish(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """The blocks' output [T, dim] of the documents `cu_seqlens` -> the encoder's output: each document's
        `pool` neighbours averaged (AvgPool1d(pool), a last partial group dropped), then the final norm."""
        pool = self.args.pool
        if pool > 1:
            docs = [
                x[start : start + (end - start) // pool * pool].unflatten(0, (-1, pool)).mean(1)
                for start, end in itertools.pairwise(cu_seqlens)
            ]
            x = torch.cat(docs)
        return self.norm(x)

    def embed(
        self, mels: torch.Tensor, frames: Counts, shard: EncoderShard | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """`forward`'s stem: the blocks' input (subsampled frames plus positions) and its documents' bounds."""
        frame_counts = host_ints(frames)
        if sum(frame_counts) != mels.shape[0]:
            raise ValueError(f"audio_frames sum to {sum(frame_counts)}, but {mels.shape[0]} mel frames were given")
        if max(frame_counts, default=0) > self.args.max_frames:
            raise ValueError(f"an audio clip exceeds max_frames={self.args.max_frames}: {frame_counts}")
        if shard is not None and len(frame_counts) != 1:
            raise ValueError(f"a sequence shard splits one audio clip, got {len(frame_counts)}: {frame_counts}")
        clips = [self.subsample(clip) for clip in mels.to(self.conv1.weight.dtype).split(frame_counts)]
        cu_seqlens = [0]
        for count, clip in zip(frame_counts, clips):
            if clip.shape[0] != audio_tokens(count):
                raise ValueError(
                    f"a clip of {count} frames gave {clip.shape[0]} embeddings, expected {audio_tokens(count)}: "
                    "frames per clip must be a multiple of 2"
                )
            cu_seqlens.append(cu_seqlens[-1] + clip.shape[0])
        if shard is None:
            positions = torch.cat([torch.arange(clip.shape[0], device=mels.device) for clip in clips])
        else:
            if shard.offset + shard.length > clips[0].shape[0]:
                raise ValueError(
                    f"shard tokens {shard.offset}..{shard.offset + shard.length} exceed the clip's "
                    f"{clips[0].shape[0]} tokens ({frame_counts[0]} frames)"
                )
            clips = [clips[0][shard.offset : shard.offset + shard.length]]
            positions = torch.arange(shard.offset, shard.offset + shard.length, device=mels.device)
            cu_seqlens = [0, shard.length]
        return torch.cat(clips) + sinusoids(positions, self.args.dim).to(clips[0].dtype), cu_seqlens
