"""How data ranks form balancing groups: the one rule of workload balancing (`balance`) that a launch asks
before any loader exists. It lives apart from the balancing itself so that the launch checks
(`runtime.preflight`) ask the same rule without importing the packer, and torch with it."""

from __future__ import annotations


def balance_group_size(policy: str, group_size: int, dp: int, shards_per_node: int) -> int:
    """Data ranks per balancing group: 1 under `none`, all of them under `global`, else `group_size` (0: the
    data shards of one node), which must divide the data ranks."""
    if policy == "none":
        return 1
    if policy == "global":
        return dp
    size = group_size or max(1, min(dp, shards_per_node))
    if dp % size:
        raise ValueError(f"data.balance.group_size={size} must divide the {dp} data ranks")
    return size
