"""The alpha-beta model of collectives: what every communication term of the cost model is priced with.

A collective over n ranks takes latency steps x the link's latency plus the share of the buffer each rank
moves over the link's bandwidth (ring algorithms, `ring_volume`). A group whose ranks lie within one node
uses the intra-node link. A group across nodes gets the nodes' NICs' share of its ranks: the node's GPUs
all run the same collective at once (SPMD), so a group with g of a node's k ranks gets g/k of the NICs'
bandwidth (a ring through the node carries its traffic over them), never more than the intra-node link;
the calibration's per-kind factors
(`Efficiency.collectives`, e.g. gloo's all-to-all) scale the link's all-reduce figures. An all-reduce across
GPU nodes takes NCCL's double binary tree where its latency is lower than the ring's, 2 log2(n) steps instead of
2(n - 1) (NCCL chooses the tree for latency-bound sizes; it moves about the ring's bytes), which is what the
step's small synchronising all-reduces over thousands of ranks cost; inside a node, and on CPU ranks (gloo's
ring), the ring. It knows links and ranks only, nothing of plans, so the calibration
(`omni_core.measure.calibrate`) fits its figures with it.
"""

from __future__ import annotations

import math
from functools import lru_cache

from omni_core.common.catalog import GpuSpec

SMALL_MESSAGE_BYTES = 64.0  # a latency-bound message: split sizes, statistics, a scalar


def ring_volume(kind: str, n: int) -> tuple[int, float]:
    """(latency steps, share of the buffer each rank moves) of a collective over n ranks, ring algorithms:
    all-reduce 2(n-1) steps moving 2(n-1)/n of it; all-gather, reduce-scatter and all-to-all n-1 steps
    moving (n-1)/n; p2p one step moving all of it."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n
    return 1, 1.0


def collective_time(
    kind: str, nbytes: float, n: int, bw: float, lat: float, calls: float = 1.0, tree: bool = False
) -> float:
    """Alpha-beta time of `calls` collectives moving `nbytes` per rank in total over n ranks (`ring_volume`);
    `tree`: an all-reduce's latency steps are a double binary tree's where fewer, 2 ceil(log2 n)."""
    if n <= 1 and kind != "p2p":
        return 0.0
    steps, volume = ring_volume(kind, n)
    if tree and kind == "all_reduce":
        steps = min(steps, 2 * math.ceil(math.log2(n)))
    return calls * steps * lat + volume * nbytes / bw


_UNSCALED = (1.0, 1.0)


@lru_cache(maxsize=64)
def kind_scales(collectives: tuple[tuple[str, float, float], ...]) -> dict[str, tuple[float, float]]:
    """(latency, bandwidth) multipliers by collective kind, from `Efficiency.collectives`' triples."""
    return {kind: (lat, bw) for kind, lat, bw in collectives}


class Network:
    """Collective times on one Cell: the link by the group's span (intra- or inter-node), per-kind factors."""

    __slots__ = ("inter_lat", "intra", "nic_bw", "per_node", "scales", "tree")

    def __init__(
        self,
        gpu: GpuSpec,
        gpus_per_node: int,
        link: float = 1.0,
        collectives: tuple[tuple[str, float, float], ...] = (),
    ):
        """`link`: the share of the links' bandwidth collectives reach (`Efficiency.link`); `collectives`:
        per-kind (kind, latency, bandwidth) multipliers (`Efficiency.collectives`)."""
        self.intra = (gpu.intra_bw * link, gpu.intra_lat)
        self.nic_bw, self.inter_lat = gpu.nic_bw * link, gpu.inter_lat
        self.per_node = gpus_per_node
        self.scales = kind_scales(collectives)
        self.tree = gpu.name != "cpu"  # NCCL's trees across GPU nodes; the CPU device's ranks (gloo) reduce in rings

    def time(self, kind: str, nbytes: float, n: int, span: int, calls: float = 1.0) -> float:
        """`calls` collectives of `kind` over n ranks lying within `span` consecutive ranks (evenly spaced)."""
        if n <= 1 and kind != "p2p":
            return 0.0
        across = span > self.per_node
        bw, lat = self.across_nodes(n, span) if across else self.intra
        lat_scale, bw_scale = self.scales.get(kind, _UNSCALED)
        return collective_time(kind, nbytes, n, bw * bw_scale, lat * lat_scale, calls, tree=across and self.tree)

    def send(self, nbytes: float, across: bool, senders: int, calls: float = 1.0) -> float:
        """`calls` point-to-point messages moving `nbytes` in all, inside a node, or across nodes while
        `senders` of the node's ranks send across at once (they share its NICs)."""
        bw, lat = (min(self.intra[0], self.nic_bw / senders), self.inter_lat) if across else self.intra
        lat_scale, bw_scale = self.scales.get("p2p", _UNSCALED)
        return collective_time("p2p", nbytes, 2, bw * bw_scale, lat * lat_scale, calls)

    def across_nodes(self, n: int, span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a group of n ranks spread over the nodes its `span` covers: its share of
        each node's NICs (its ranks there over the node's ranks), at most the intra-node link."""
        nodes = math.ceil(span / self.per_node)
        ranks_here = math.ceil(n / nodes)
        return min(self.intra[0], self.nic_bw * ranks_here / self.per_node), self.inter_lat
