"""Images and video frames -> patch sequences at (near) native resolution, NaViT style: the patch grid follows
the image's aspect ratio and is scaled (both sides by one factor) only to stay within [min, max] patches.

`patch_grid` is the token rule the packer applies to metadata, vectorized over whole chunks of samples, so it
must agree exactly with what `patchify` produces from the decoded pixels. The rules and headers need no
tensor, so torch is imported by `patchify` alone: a launch check reads a sample's token count without it.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageSequence

if TYPE_CHECKING:
    import torch


class OversizedImage(ValueError):
    """More pixels than data.max_image_pixels: never decoded (a decompression bomb or a mislabelled scan)."""


def patch_grid(width, height, patch_size: int, max_patches: int, min_patches: int = 1):
    """(rows, cols) of patches for width x height images (scalars or arrays of the same shape).

    ceil(side / patch) when that lands within [min_patches, max_patches]; above it both sides are scaled by
    sqrt(max / area) and floored, so the product cannot exceed the budget; below it they are scaled up by
    sqrt(min / area) and rounded up (or, if that overshoots the budget, handled as above)."""
    w = np.asarray(width, dtype=np.float64)
    h = np.asarray(height, dtype=np.float64)
    area = np.maximum(w * h, 1.0)
    p = float(patch_size)
    rows, cols = np.ceil(h / p), np.ceil(w / p)
    up = np.sqrt(min_patches * p * p / area)
    up_rows, up_cols = np.ceil(h * up / p), np.ceil(w * up / p)
    small = rows * cols < min_patches
    rows, cols = np.where(small, up_rows, rows), np.where(small, up_cols, cols)
    down = np.sqrt(max_patches * p * p / area)
    down_rows = np.clip(np.floor(h * down / p), 1, max_patches)
    down_cols = np.clip(np.floor(w * down / p), 1, np.floor(max_patches / down_rows))
    big = rows * cols > max_patches
    rows, cols = np.where(big, down_rows, rows).astype(np.int64), np.where(big, down_cols, cols).astype(np.int64)
    if rows.ndim == 0:
        return int(rows), int(cols)
    return rows, cols


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Fully decoded RGB image. The size is checked from the header before any pixel is decoded; a truncated
    or foreign file fails here (OSError / ValueError), not later in patchify."""
    with Image.open(io.BytesIO(data)) as img:
        if img.width * img.height > max_pixels:
            raise OversizedImage(f"{img.width}x{img.height} exceeds max_image_pixels={max_pixels}")
        img.load()
        return img.convert("RGB")


def image_header(data: bytes) -> tuple[int, int]:
    """(width, height) from the header alone: how sizes are found when a sample carries no metadata."""
    with Image.open(io.BytesIO(data)) as img:
        return img.width, img.height


def patchify(
    img: Image.Image, patch_size: int, max_patches: int, min_patches: int = 1
) -> tuple[torch.Tensor, tuple[int, int]]:
    """[rows*cols, 3*p*p] patches in row-major grid order, each flattened as (channel, y, x) so that a
    Linear over it equals a Conv2d(kernel=stride=p) patch embedding; pixel values in [-1, 1]."""
    import torch

    rows, cols = patch_grid(img.width, img.height, patch_size, max_patches, min_patches)
    size = (cols * patch_size, rows * patch_size)
    if img.size != size:
        img = img.resize(size, Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(img, dtype=np.float32)) / 127.5 - 1.0  # [H, W, 3]
    p = patch_size
    patches = pixels.view(rows, p, cols, p, 3).permute(0, 2, 4, 1, 3).reshape(rows * cols, 3 * p * p)
    return patches.contiguous(), (rows, cols)


def sampled_frames(num_frames, max_frames: int):
    """Frames a clip contributes: all of them up to max_frames (scalar or array)."""
    return np.minimum(num_frames, max_frames)


def frame_indices(num_frames: int, max_frames: int) -> list[int]:
    """Evenly spaced frame indices, first and last included: the clip's whole time span at a lower rate."""
    count = int(sampled_frames(num_frames, max_frames))
    return np.linspace(0, num_frames - 1, count).round().astype(int).tolist()


def video_header(data: bytes) -> tuple[int, int, int]:
    """(width, height, frames) of an animated GIF/WebP/PNG from its header and frame table."""
    with Image.open(io.BytesIO(data)) as clip:
        return clip.width, clip.height, getattr(clip, "n_frames", 1)


def open_video_frames(data: bytes, max_frames: int, max_pixels: int) -> tuple[list[Image.Image], int]:
    """The sampled RGB frames of an animated image (GIF, WebP, APNG: what Pillow decodes without a video
    codec) and the clip's frame count."""
    with Image.open(io.BytesIO(data)) as clip:
        if clip.width * clip.height > max_pixels:
            raise OversizedImage(f"{clip.width}x{clip.height} frames exceed max_image_pixels={max_pixels}")
        total = getattr(clip, "n_frames", 1)
        wanted = frame_indices(total, max_frames)  # distinct: their spacing is at least 1
        frames: list[Image.Image] = []
        for k, frame in enumerate(ImageSequence.Iterator(clip)):  # frames decode in order: stop at the last needed
            if k in wanted:
                frames.append(frame.convert("RGB"))
                if len(frames) == len(wanted):
                    return frames, total
        raise OSError(f"clip ends after {len(frames)} of the {len(wanted)} sampled frames")
