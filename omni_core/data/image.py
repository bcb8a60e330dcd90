"""Images -> patch sequences at (near) native resolution, NaViT style: the patch grid follows the image's
aspect ratio and is only scaled down when it exceeds the patch budget. `patch_grid` is the token rule the
packer uses from manifest metadata, so it must agree exactly with what `patchify` produces."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def patch_grid(width: int, height: int, patch_size: int, max_patches: int) -> tuple[int, int]:
    """(rows, cols) of patches for a width x height image: ceil(side / patch) when that fits the budget,
    else both sides scaled by the same factor (floored, so the product can never exceed the budget)."""
    rows, cols = math.ceil(height / patch_size), math.ceil(width / patch_size)
    if rows * cols <= max_patches:
        return rows, cols
    scale = math.sqrt(max_patches * patch_size * patch_size / (width * height))
    rows = max(1, min(math.floor(height * scale / patch_size), max_patches))
    cols = max(1, min(math.floor(width * scale / patch_size), max_patches // rows))
    return rows, cols


def load_image(path: Path) -> Image.Image:
    """Fully decoded RGB image; a truncated or foreign file fails here (OSError), not later in patchify."""
    with Image.open(path) as img:
        img.load()
        return img.convert("RGB")


def patchify(img: Image.Image, patch_size: int, max_patches: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """[rows*cols, 3*p*p] patches in row-major grid order, each flattened as (channel, y, x) so that a
    Linear over it equals a Conv2d(kernel=stride=p) patch embedding; pixel values in [-1, 1]."""
    rows, cols = patch_grid(img.width, img.height, patch_size, max_patches)
    size = (cols * patch_size, rows * patch_size)
    if img.size != size:
        img = img.resize(size, Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(img, dtype=np.float32)) / 127.5 - 1.0  # [H, W, 3]
    p = patch_size
    patches = pixels.view(rows, p, cols, p, 3).permute(0, 2, 4, 1, 3).reshape(rows * cols, 3 * p * p)
    return patches.contiguous(), (rows, cols)
