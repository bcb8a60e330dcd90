"""Keys and values of a batch of left-padded sequences being decoded, kept per layer so that each new token
attends to them instead of recomputing the whole prefix (`LLM.forward_cached`).

Sequences of different lengths share one [B, Hkv, S, D] tensor per layer, left-padded: every sequence's newest
token then sits in the same column, so one decode step appends one column for all. `pad` says how many leading
columns of each row are padding, which no real query attends to.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, pad: torch.Tensor):
        self.pad = pad  # [B] leading padding columns of each sequence
        self.keys: dict[str, torch.Tensor] = {}  # layer name -> [B, Hkv, S, D]
        self.values: dict[str, torch.Tensor] = {}
        self.length = 0  # columns held (the same in every layer once a forward has run)

    def append(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add `k`, `v` [B, Hkv, S_new, D] to `layer`'s columns and return all of them.

        Concatenation reallocates per step; at the lengths evaluation decodes (tens to hundreds of tokens)
        that copy is small next to the layer's matmuls, and no maximum length has to be fixed up front."""
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def mask(self, new: int, window: int | None) -> torch.Tensor:
        """Which of the `length + new` columns each of the `new` queries attends to: [B, 1, new, length + new].

        Causal, not into a row's padding, and within `window` keys of the query (itself included) where set.
        A padding query attends to itself alone, so that no row is empty (SDPA would return NaN there); its
        output is never read, and real queries never attend to it."""
        total = self.length + new
        device = self.pad.device
        query = torch.arange(self.length, total, device=device)[:, None]
        key = torch.arange(total, device=device)[None, :]
        allowed = key <= query
        if window is not None:
            allowed = allowed & (key > query - window)
        allowed = allowed[None] & (key[None] >= self.pad[:, None, None])
        allowed = allowed | (key == query)[None]
        return allowed[:, None]

    def positions(self, new: int) -> torch.Tensor:
        """RoPE positions [B, new] of the next `new` columns: counted from each row's first real token."""
        columns = torch.arange(self.length, self.length + new, device=self.pad.device)
        return (columns[None, :] - self.pad[:, None]).clamp(min=0)
