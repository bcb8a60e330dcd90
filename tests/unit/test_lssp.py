"""LSSP's host-side pieces: how an item's tokens are split over an LSSP group, and why vision aligns the split to
whole merge rows (the projector's spatial merge of each chunk is then local). The collectives run in
tests/ranks/test_lssp_ranks.py."""

from __future__ import annotations

import pytest
import torch

from omni_core.models.attention import EncoderAttention
from omni_core.models.projector import spatial_merge
from omni_core.parallel.lssp import lssp_splits


@pytest.mark.parametrize(("n_tokens", "size", "align", "splits"), [
    (48, 2, 12, [24, 24]),  # 8x6 patches, merge 2: 4 merge rows of 12
    (36, 2, 12, [12, 24]),  # 3 merge rows over 2: the extra one goes to the last member
    (42, 2, 12, [24, 18]),  # 7 rows: the last member ends with the partial merge row
    (30, 2, 12, [12, 18]),  # 5 rows: the last member's extra unit evens out its partial one
    (20, 4, 1, [5, 5, 5, 5]),
    (21, 2, 1, [10, 11]),
    (4, 4, 1, [1, 1, 1, 1]),
])
def test_lssp_splits_are_aligned_and_even(n_tokens, size, align, splits):
    assert lssp_splits(n_tokens, size, align) == splits
    assert all(split % align == 0 for split in splits[:-1])


@pytest.mark.parametrize(("n_tokens", "size", "align", "message"), [
    (36, 4, 12, "36 tokens make 3 chunks of 12, too few for an LSSP group of 4"),
    (3, 4, 1, "3 tokens make 3 chunks of 1, too few for an LSSP group of 4"),
    (8, 0, 1, "size=0"),
])
def test_lssp_splits_refuse_items_too_short_to_split(n_tokens, size, align, message):
    with pytest.raises(ValueError, match=message):
        lssp_splits(n_tokens, size, align)


@pytest.mark.parametrize(("rows", "cols", "size"), [(8, 6, 2), (7, 6, 2), (6, 5, 3), (9, 4, 4)])
def test_merge_row_aligned_chunks_merge_locally(rows, cols, size):
    """A chunk of whole merge rows is itself a (chunk rows) x cols grid: merging chunks one by one gives the
    whole image's merged tokens, in order, so each member projects its own chunk."""
    merge = 2
    x = torch.randn(rows * cols, 3)
    splits = lssp_splits(rows * cols, size, merge * cols)
    chunks = [spatial_merge(chunk, torch.tensor([[len(chunk) // cols, cols]]), merge) for chunk in x.split(splits)]
    assert torch.equal(torch.cat(chunks), spatial_merge(x, torch.tensor([[rows, cols]]), merge))


def test_encoder_attention_refuses_a_shard_over_several_documents():
    class WholeChunk:  # any object with offset, length and attend is a shard to the models
        offset, length = 0, 4

        def attend(self, q, k, v):
            return q

    with pytest.raises(ValueError, match="chunk of one document"):
        EncoderAttention(8, 2)(torch.zeros(4, 8), [0, 2, 4], WholeChunk())
