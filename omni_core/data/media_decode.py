"""Decoding a media file's bytes as its segment kind, and naming the skip reason when that fails: shared by
the JSONL and WebDataset sources, which differ only in where the bytes come from."""

from __future__ import annotations

from typing import Any

from PIL import Image

from omni_core.data.audio import EmptyAudio, read_audio
from omni_core.data.image import OversizedImage, open_image, open_video_frames
from omni_core.data.sample import Segment
from omni_core.data.source_base import CorruptSample
from omni_core.recipe.data_sections import DataConfig


def decode_media(seg: Segment, data: bytes, cfg: DataConfig) -> Any:
    """A media file's bytes decoded as its segment kind; raises OversizedImage, EmptyAudio, or what the
    decoders raise for bad bytes."""
    if seg.kind == "image":
        return open_image(data, cfg.max_image_pixels)
    if seg.kind == "video":
        return open_video_frames(data, cfg.video_max_frames, cfg.max_image_pixels)
    return read_audio(data)


def media_error(sample_id: str, where: str, err: Exception) -> CorruptSample:
    """The skip reason of a decoding failure."""
    reason = (
        "missing_file"
        if isinstance(err, FileNotFoundError)
        else "oversized_image"
        if isinstance(err, (OversizedImage, Image.DecompressionBombError))
        else "empty_audio"
        if isinstance(err, EmptyAudio)
        else "unreadable_file"
    )
    return CorruptSample(sample_id, where, reason, str(err))


DECODE_ERRORS = (OSError, ValueError, RuntimeError, EOFError, SyntaxError, Image.DecompressionBombError)
