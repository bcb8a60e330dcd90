"""Expert parallelism, without a process group: the experts an EP rank keeps (against the single-process MoE on
ranks: tests/ranks/test_expert_parallel_ranks.py)."""

from __future__ import annotations

import pytest

from omni_core.parallel.expert import local_experts


def test_local_experts_need_ep_to_divide_the_experts() -> None:
    assert local_experts(8, 4, 2) == range(4, 6)
    with pytest.raises(ValueError, match="ep=4 does not divide num_experts=6"):
        local_experts(6, 4, 0)
