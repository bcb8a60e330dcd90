"""5D parallelism without ranks: which data shard each rank of a plan reads (every plan training like one
process on gloo: tests/ranks/test_parallel_ranks.py)."""

from __future__ import annotations

from omni_core.common.plan import ParallelPlan


def test_ranks_sharing_a_data_shard_differ_only_in_pp_cp_tp():
    plan = ParallelPlan.parse("dp2x2-tp2-pp2-cp2r")
    shards = [plan.data_rank(rank) for rank in range(plan.world_size)]
    assert sorted(set(shards)) == [0, 1, 2, 3]
    for rank in range(plan.world_size):
        coords = plan.coordinates(rank)
        assert shards[rank] == coords["dp_replicate"] * 2 + coords["dp_shard"]
    assert plan.coordinates(plan.world_size - 1) == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
