"""Batches of a pretrained LLM's ids: the layout finds its placeholders and padding by the tokenizer's ids (padding
that is EOS included), packing's labels never target placeholders or padding, and text is counted in its tokens."""

from __future__ import annotations

import pytest
import torch

from omni_core.common.batch import PackedBatch
from omni_core.common.tokenizer import BYTE_TOKENIZER, HFTokenizer, Tokenizer
from tests.helpers.hf_tokenizer import write_tokenizer


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> HFTokenizer:
    """Qwen2-like: no BOS, no pad token (pads with EOS), placeholders added past the base vocabulary."""
    return HFTokenizer.from_pretrained(write_tokenizer(tmp_path_factory.mktemp("tok") / "chatml", "chatml"))


def hand_batch(docs: list[list[int]], tokenizer: Tokenizer) -> PackedBatch:
    ids = torch.tensor([t for doc in docs for t in doc])
    offsets = torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0).tolist()], dtype=torch.int32)
    return PackedBatch(
        input_ids=ids,
        labels=torch.full_like(ids, -100),
        position_ids=torch.cat([torch.arange(len(d)) for d in docs]),
        cu_seqlens=offsets,
        loss_modality=torch.zeros_like(ids),
        image_patches=torch.zeros(2, 12),
        image_grids=torch.tensor([[1, 2]]),
        audio_mels=torch.zeros(0, 4),
        audio_frames=torch.zeros(0, dtype=torch.long),
        video_patches=torch.zeros(0, 12),
        video_grids=torch.zeros(0, 3, dtype=torch.long),
        num_samples=1,
        tokenizer=tokenizer,
    )


def test_layout_reads_the_tokenizers_ids_and_padding_that_is_eos(chatml):
    eos, image = chatml.eos_id, chatml.placeholder_ids["image"]
    text = chatml.encode("what colour")
    real = [*text, image, image, *text, eos]
    layout = hand_batch([real, [eos] * 3, [eos] * 2], chatml).layout
    assert layout.padding_docs == (1, 2) and layout.real_tokens == len(real)  # its EOS is real, not padding
    assert layout.placeholder_positions == {"image": (len(text), len(text) + 1), "video": (), "audio": ()}
    as_bytes = hand_batch([real], BYTE_TOKENIZER).layout  # the same ids read as the byte tokenizer's
    assert as_bytes.placeholder_positions["image"] != layout.placeholder_positions["image"]
