"""Which rank does what in the encoder step (`parallel.encoders`), read off the plan alike on every rank: the
data shard each LLM rank loads, the rank that publishes each shard's items and sends their inputs, the ranks
that take encoded rows, and the ranks that may encode a shard's items. The last is where the two layouts
differ: under `omni` a shard's items stay within its balancing group of LLM ranks, under `disaggregated` any
of the encoders' own ranks (which load no data and hold no LLM) takes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_core.common.plan import ParallelPlan


@dataclass(frozen=True)
class RankRoles:
    """This rank's view of every rank's role. `coords` and `shard_of` cover the LLM's ranks only."""

    plan: ParallelPlan
    rank: int
    world: int
    coords: list[dict[str, int]]  # each LLM rank's mesh coordinates
    shard_of: list[int]  # each LLM rank's data shard
    owner_of_shard: dict[int, int]  # each data shard's first rank: it publishes the items and sends the inputs

    @classmethod
    def of(cls, plan: ParallelPlan, rank: int, world: int) -> RankRoles:
        coords = [plan.coordinates(r) for r in range(plan.llm_world_size)]
        shard_of = [plan.data_rank(r) for r in range(plan.llm_world_size)]
        owners: dict[int, int] = {}
        for r, shard in enumerate(shard_of):
            owners.setdefault(shard, r)
        return cls(plan, rank, world, coords, shard_of, owners)

    def holds(self, rank: int, shard: int) -> bool:
        """Whether `rank` loads data shard `shard` (it has the shard's inputs at hand)."""
        return rank < self.plan.llm_world_size and self.shard_of[rank] == shard

    def owns_shard(self) -> bool:
        """Whether this rank publishes its data shard's items."""
        return self.rank < self.plan.llm_world_size and self.owner_of_shard[self.shard_of[self.rank]] == self.rank

    def consumes(self) -> bool:
        """Whether this rank's LLM takes encoder rows (pipeline stage 0 of the LLM's ranks)."""
        return self.rank < self.plan.llm_world_size and self.coords[self.rank]["pp"] == 0

    def sends_gradient(self, consumer: int) -> bool:
        """Whether a consumer returns its rows' gradient: TP rank 0 only (its peers hold the same rows)."""
        return self.coords[consumer]["tp"] == 0

    def consumers(self, shard: int) -> list[int]:
        """Stage-0 LLM ranks of a data shard: each needs the rows of its CP share."""
        return [r for r in range(self.plan.llm_world_size) if self.shard_of[r] == shard and self.coords[r]["pp"] == 0]

    def domains(self, group: int) -> dict[int, tuple[int, ...]] | None:
        """Under `omni`, the ranks that encode a shard's items: those of the shards of its balancing group (the
        loaders' `data.balance` group: `group` consecutive data shards; 0: the world). Under `disaggregated`
        every encoder rank (None)."""
        if self.plan.encoders.ranks or not group:
            return None
        return {
            shard: tuple(r for r, s in enumerate(self.shard_of) if s // group == shard // group)
            for shard in self.owner_of_shard
        }
