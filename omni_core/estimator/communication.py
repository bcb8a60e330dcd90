"""The alpha-beta model of collectives: what every communication term of the cost model is priced with.

A collective over n ranks takes latency steps x the link's latency plus the share of the buffer each rank
moves over the link's bandwidth (ring algorithms, `ring_volume`). A group whose ranks lie within one node
uses the intra-node link, otherwise the inter-node one; the calibration's per-kind factors
(`Efficiency.collectives`, e.g. gloo's all-to-all) scale the link's all-reduce figures. It knows links and
ranks only, nothing of plans, so the calibration (`omni_core.measure.calibrate`) fits its figures with it.
"""

from __future__ import annotations

from functools import lru_cache

from omni_core.common.catalog import GpuSpec


def ring_volume(kind: str, n: int) -> tuple[int, float]:
    """(latency steps, share of the buffer each rank moves) of a collective over n ranks, ring algorithms:
    all-reduce 2(n-1) steps moving 2(n-1)/n of it; all-gather, reduce-scatter and all-to-all n-1 steps
    moving (n-1)/n; p2p one step moving all of it."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n
    return 1, 1.0


def collective_time(kind: str, nbytes: float, n: int, bw: float, lat: float, calls: float = 1.0) -> float:
    """Alpha-beta time of `calls` collectives moving `nbytes` per rank in total over n ranks (`ring_volume`)."""
    if n <= 1 and kind != "p2p":
        return 0.0
    steps, volume = ring_volume(kind, n)
    return calls * steps * lat + volume * nbytes / bw


_UNSCALED = (1.0, 1.0)


@lru_cache(maxsize=64)
def kind_scales(collectives: tuple[tuple[str, float, float], ...]) -> dict[str, tuple[float, float]]:
    """(latency, bandwidth) multipliers by collective kind, from `Efficiency.collectives`' triples."""
    return {kind: (lat, bw) for kind, lat, bw in collectives}


class Network:
    """Collective times on one Cell: the link by the group's span (intra- or inter-node), per-kind factors."""

    __slots__ = ("inter", "intra", "per_node", "scales")

    def __init__(self, gpu: GpuSpec, gpus_per_node: int, link: float = 1.0,
                 collectives: tuple[tuple[str, float, float], ...] = ()):
        """`link`: the share of the links' bandwidth collectives reach (`Efficiency.link`); `collectives`:
        per-kind (kind, latency, bandwidth) multipliers (`Efficiency.collectives`)."""
        self.intra = (gpu.intra_bw * link, gpu.intra_lat)
        self.inter = (gpu.inter_bw * link, gpu.inter_lat)
        self.per_node = gpus_per_node
        self.scales = kind_scales(collectives)

    def time(self, kind: str, nbytes: float, n: int, span: int, calls: float = 1.0) -> float:
        """`calls` collectives of `kind` over n ranks lying within `span` consecutive ranks."""
        if n <= 1 and kind != "p2p":
            return 0.0
        bw, lat = self.intra if span <= self.per_node else self.inter
        lat_scale, bw_scale = self.scales.get(kind, _UNSCALED)
        return collective_time(kind, nbytes, n, bw * bw_scale, lat * lat_scale, calls)
