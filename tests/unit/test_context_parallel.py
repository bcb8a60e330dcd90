"""Context-parallel attention (omni_core/parallel/context.py), the pieces that need no process group: the zig-zag
token split, the Ulysses head split and the ring's causal tile schedule (against `varlen_attention` on ranks:
tests/ranks/test_context_parallel_ranks.py)."""

from __future__ import annotations

import pytest
import torch

from omni_core.parallel.context import _ring_layout, cp_token_index, ulysses_kv_repeats


def test_cp_token_index_partitions_zig_zag():
    for kind in ("ulysses", "ring"):
        indices = [cp_token_index(16, 4, rank, kind) for rank in range(4)]
        assert sorted(torch.cat(indices).tolist()) == list(range(16))
    assert cp_token_index(16, 4, 0, "ulysses").tolist() == [0, 1, 2, 3]
    assert cp_token_index(16, 4, 1, "ring").tolist() == [2, 3, 12, 13]  # chunks 1 and 2*4-1-1 = 6
    with pytest.raises(ValueError, match="divisible by 8"):
        cp_token_index(12, 4, 0, "ring")


def test_heads_must_split_over_ulysses_ranks():
    assert ulysses_kv_repeats(8, 8, 4) == 1
    assert ulysses_kv_repeats(8, 2, 4) == 2
    assert ulysses_kv_repeats(12, 4, 6) == 3  # lcm(4, 6) = 12 KV heads
    with pytest.raises(ValueError, match="6 heads do not divide by cp=4"):
        ulysses_kv_repeats(6, 2, 4)


def test_ring_skips_causally_masked_tiles():
    # One document, cp=2: rank 0 holds chunks 0 and 3; rank 1's keys (chunks 1, 2) are only visible from chunk 3,
    # and to all of it, so the mask is not even built.
    schedule, _, _ = _ring_layout((0, 16), frozenset(), 16, True, 2, 0, 1024, torch.device("cpu"))
    assert schedule[1] == ((4, 8, 0, 4, 4, True), (4, 8, 4, 8, 8, True))
    assert len(schedule[0]) == 3  # chunk 0 x chunk 0 (masked), chunk 3 x chunk 0 (full), chunk 3 x chunk 3


def test_ring_padding_queries_see_no_key_and_their_tiles_are_skipped():
    # Documents [0, 6) and padding [6, 8), cp=2: rank 1 holds chunks 1 (tokens 2, 3) and 2 (4, 5); rank 0 holds
    # chunks 0 (0, 1) and 3 (6, 7), the padding, whose queries get an empty interval: no tile of theirs is built.
    schedule, lo, hi = _ring_layout((0, 6, 8), frozenset({1}), 8, True, 2, 0, 1, torch.device("cpu"))
    assert lo.tolist() == [0, 0, 6, 6] and hi.tolist() == [1, 2, 6, 6]
    assert all(q0 < 2 for tiles in schedule for q0, *_ in tiles)
