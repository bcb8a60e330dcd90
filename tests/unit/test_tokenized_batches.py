"""Batches of a pretrained LLM's ids: the layout finds its placeholders and padding by the tokenizer's ids (padding
that is EOS included), packing's labels never target placeholders or padding, and text is counted in its tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from omni_core.common.batch import PackedBatch
from omni_core.common.tokenizer import (
    BOS_ID,
    BYTE_TOKENIZER,
    EOS_ID,
    IMAGE_ID,
    HFTokenizer,
    Tokenizer,
    never_predicted,
)
from omni_core.data.dataset import ManifestDataset, open_source
from omni_core.data.packing import collate, document_labels
from omni_core.recipe.data_sections import DataConfig
from tests.helpers.data_sources import records
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


def write_manifest(folder: Path) -> Path:
    Image.new("RGB", (16, 8), (200, 10, 10)).save(folder / "box.png")
    lines = [
        {"id": "a", "segments": [{"type": "image", "path": "box.png", "width": 16, "height": 8},
                                 {"type": "text", "text": "a red box on white."}]},
        {"id": "b", "segments": [{"type": "text", "text": "héllo café, what colour?"}]},
    ]
    (folder / "manifest.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder / "manifest.jsonl"


def test_samples_are_measured_laid_out_and_labelled_in_the_llms_tokens(chatml, tmp_path):
    cfg = DataConfig(source="jsonl", seq_len=64, micro_batch=1, patch_size=8, heldout_fraction=0.001)
    dataset = ManifestDataset(write_manifest(tmp_path), cfg, chatml)
    by_id = {r.id: r for r in records(dataset)}
    caption, text = chatml.encode("a red box on white."), chatml.encode("héllo café, what colour?")
    assert by_id["a"].tokens == 2 + len(caption) + 1 and by_id["b"].tokens == len(text) + 1  # no BOS in Qwen2's
    image = dataset.decode(by_id["a"])
    assert image.input_ids == [chatml.placeholder_ids["image"]] * 2 + caption + [chatml.eos_id]
    batch = collate([[image, dataset.decode(by_id["b"])]], cfg, chatml)
    used = len(image.input_ids) + len(text) + 1
    ids, labels = batch.input_ids.tolist(), batch.labels.tolist()
    assert ids[:used] == image.input_ids + text + [chatml.eos_id]
    assert set(ids[used:]) == {chatml.pad_id} == {chatml.eos_id} and len(ids) == cfg.seq_len
    expected = [-100, *caption, chatml.eos_id, -100, *text[1:], chatml.eos_id, -100]  # the placeholder is no target
    assert labels[:used] == expected and set(labels[used:]) == {-100}  # padding that is EOS has no target
    assert batch.layout.real_tokens == used and batch.layout.placeholder_positions["image"] == (0, 1)


def test_dynamic_source_is_refused_with_a_pretrained_tokenizer(chatml):
    with pytest.raises(ValueError, match="data.source=dynamic draws its text's length in bytes"):
        open_source("dynamic", DataConfig(source="dynamic"), chatml)
    assert open_source("dynamic", DataConfig(source="dynamic")) is not None


def test_labels_skip_placeholders_bos_and_pad_and_follow_a_mask():
    ids = torch.tensor([BOS_ID, *b"hi", IMAGE_ID, *b"!", EOS_ID])
    assert document_labels(ids, BYTE_TOKENIZER).tolist() == [*b"hi", -100, *b"!", EOS_ID, -100]
    mask = [False, False, False, False, True, True]
    assert document_labels(ids, BYTE_TOKENIZER, mask).tolist() == [-100, -100, -100, *b"!", EOS_ID, -100]


def test_an_id_that_is_also_eos_stays_a_target(chatml, tmp_path):
    """GPT-2 names one token BOS and EOS; Qwen2 pads with EOS: EOS is still predicted where a document ends."""
    folder = write_tokenizer(tmp_path / "gpt2", "chatml")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": config["eos_token"]}))
    gpt2 = HFTokenizer.from_pretrained(folder)
    assert gpt2.bos_id == gpt2.eos_id == gpt2.pad_id and gpt2.eos_id not in never_predicted(gpt2)
    assert never_predicted(chatml) == set(chatml.placeholder_ids.values())
    ids = torch.tensor([gpt2.eos_id, *gpt2.encode("hi"), gpt2.eos_id])
    assert document_labels(ids, gpt2).tolist()[-2] == gpt2.eos_id
