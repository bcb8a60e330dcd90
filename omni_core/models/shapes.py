"""Encoder input shapes as host integers: image grids (rows, cols), video grids (frames, rows, cols), clips'
mel frame counts.

The training step hands the encoders these from the batch's layout (`PackedBatch.layout`), already on the
host. A tensor is read here for callers that hold only that (parity tests, generation): on a GPU, a sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Shapes = torch.Tensor | Sequence[Sequence[int]]  # [N, 2] image or [N, 3] video grids
Counts = torch.Tensor | Sequence[int]  # [N] clips' mel frames


def host_rows(shapes: Shapes) -> list[tuple[int, ...]]:
    """Grids as tuples of ints, from a tensor or from host sequences."""
    rows = shapes.tolist() if isinstance(shapes, torch.Tensor) else shapes
    return [tuple(int(v) for v in row) for row in rows]


def host_ints(counts: Counts) -> list[int]:
    """Counts as ints, from a tensor or from a host sequence."""
    return [int(v) for v in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
