"""Byte-level tokenizer: needs no download, round-trips any UTF-8 text, and reserves ids for the
special tokens the packed multimodal sequence needs (placeholders are where encoder outputs land)."""

from __future__ import annotations

NUM_BYTES = 256
PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
IMAGE_ID = 259  # one per image embedding position
AUDIO_ID = 260  # one per audio embedding position
VIDEO_ID = 261  # one per video embedding position (frames merged in time and space)
VOCAB_SIZE = 264  # rounded up to a multiple of 8, above every special id

PLACEHOLDER_IDS = {"image": IMAGE_ID, "audio": AUDIO_ID, "video": VIDEO_ID}


class ByteTokenizer:
    vocab_size = VOCAB_SIZE
    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < NUM_BYTES).decode("utf-8", errors="replace")
