"""GPU catalogue: peak compute, memory and links per GPU type, each number next to its source.

Peaks are dense (no 2:4 sparsity) datasheet figures (TF32 too: the datasheets' "TF32 tensor core" line
without sparsity); what a training step reaches of them is the `Efficiency` of the cost model, corrected
per device by the micro-profile (`calibrate.py`). Link figures are per direction: inside a node per GPU,
across nodes per node (all of a node's NICs together, which its GPUs share: a 100 Gb/s NIC is 12.5 GB/s for
the whole node). Latencies (alpha of the alpha-beta model) are typical NCCL per-hop latencies (nccl-tests on
NVLink ~ 3-5 us, PCIe ~ 10 us, InfiniBand ~ 5-10 us), not datasheet values.
Recipes add or override types through `estimate.gpus` (see `GpuCatalog.with_overrides`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, TypedDict

TFLOPS = 1e12
GBps = 1e9
GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    name: str
    bf16_flops: float  # dense tensor-core peak, FLOP/s (0: no bf16; fp16 is used instead)
    fp16_flops: float
    fp32_flops: float  # plain fp32 (CUDA cores): what an fp32 matmul gets unless TF32 is allowed
    # what a process can allocate, GB (1e9 bytes): the driver's total as PyTorch reports it (its out-of-memory
    # messages' "total capacity", in GiB) where that is published, else the datasheet's decimal figure
    mem_gb: float
    mem_bw: float  # bytes/s
    gpus_per_node: int
    intra_link: str  # "nvlink3", "pcie4", ... (for humans)
    intra_bw: float  # bytes/s per GPU per direction inside a node
    intra_lat: float  # seconds per collective step inside a node
    nic_bw: float  # bytes/s per direction across nodes, per node: all its NICs, shared by its GPUs
    inter_lat: float
    source: str = ""
    reserved_gb: float = 2.0  # context, allocator fragmentation and workspaces, never available to tensors
    cores: int = 0  # compute units a node's ranks share (CPU "devices": cores); 0: each GPU is its own
    tf32_flops: float = 0.0  # dense TF32 tensor-core peak: fp32 matmuls with TF32 allowed (0: none, or unlisted)
    # GA10x / AD10x SMs: the datasheet's fp32 counts two datapaths, one of them shared with INT32 (NVIDIA's
    # Ampere GA102 and Ada whitepapers); a kernel's integer work (addresses, loop counters) takes that one,
    # so plain-fp32 compute is priced at the dedicated datapath's half (`compute_flops`)
    fp32_shared_datapath: bool = False

    def peak_flops(self, precision: str) -> float:
        """Peak matmul FLOP/s at a precision; bf16 falls back to fp16 on GPUs without bf16 (V100), tf32 to
        plain fp32 on GPUs without TF32 tensor cores."""
        if precision == "fp32":
            return self.fp32_flops
        if precision == "tf32":
            return self.tf32_flops or self.fp32_flops
        if precision == "bf16" and self.bf16_flops:
            return self.bf16_flops
        return self.fp16_flops

    def compute_flops(self, precision: str) -> float:
        """The peak the cost model prices compute against: `peak_flops`, but plain fp32 on the dedicated
        fp32 datapath only where the datasheet counts one shared with INT32 (`fp32_shared_datapath`). MFU
        stays against the datasheet's `peak_flops`."""
        plain = precision == "fp32" or (precision == "tf32" and not self.tf32_flops)
        return self.fp32_flops / 2 if plain and self.fp32_shared_datapath else self.peak_flops(precision)

    @property
    def usable_bytes(self) -> float:
        return (self.mem_gb - self.reserved_gb) * GB


class IntraLink(TypedDict):
    """A node's GPU-to-GPU link, as `GpuSpec`'s intra_* fields (shared by the GPUs that have it)."""

    intra_link: str
    intra_bw: float
    intra_lat: float


class InterLink(TypedDict):
    """A node's network, as `GpuSpec`'s nic_bw and inter_lat fields (shared by the servers that have it)."""

    nic_bw: float
    inter_lat: float


_NVLINK3 = IntraLink(intra_link="nvlink3", intra_bw=300 * GBps, intra_lat=5e-6)  # A100: 600 GB/s bidirectional
_NVLINK4 = IntraLink(intra_link="nvlink4", intra_bw=450 * GBps, intra_lat=4e-6)  # H100/H200: 900 GB/s bidirectional
# PCIe Gen4 x16: 32 GB/s per direction theoretical, ~25 achieved
_PCIE4 = IntraLink(intra_link="pcie4", intra_bw=25 * GBps, intra_lat=10e-6)
_HDR_IB = InterLink(nic_bw=8 * 25 * GBps, inter_lat=8e-6)  # DGX/HGX A100: 8 x 200 Gb/s HDR InfiniBand per node
_NDR_IB = InterLink(nic_bw=8 * 50 * GBps, inter_lat=8e-6)  # DGX/HGX H100, H200: 8 x 400 Gb/s NDR InfiniBand per node
_ETH100 = InterLink(nic_bw=12.5 * GBps, inter_lat=15e-6)  # PCIe servers: one 100 Gb/s Ethernet NIC per node

BUILTIN: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec(
            "a100-40gb",
            312 * TFLOPS,
            312 * TFLOPS,
            19.5 * TFLOPS,
            39.59 * GiB / GB,
            1555 * GBps,
            8,
            **_NVLINK3,
            **_HDR_IB,
            source="NVIDIA A100 datasheet (SXM4 40GB): 312 TF bf16/fp16 dense, 19.5 TF fp32, 1,555 GB/s HBM2, "
            "NVLink3 600 GB/s; PyTorch reports 39.59 GiB",
            tf32_flops=156 * TFLOPS,
        ),
        GpuSpec(
            "a100-80gb",
            312 * TFLOPS,
            312 * TFLOPS,
            19.5 * TFLOPS,
            79.25 * GiB / GB,
            2039 * GBps,
            8,
            **_NVLINK3,
            **_HDR_IB,
            source="NVIDIA A100 datasheet (SXM4 80GB): 312 TF bf16/fp16 dense, 19.5 TF fp32, 2,039 GB/s HBM2e, "
            "NVLink3 600 GB/s; PyTorch reports 79.25 GiB (79.15-79.33 by driver)",
            tf32_flops=156 * TFLOPS,
        ),
        GpuSpec(
            "h100",
            989.4 * TFLOPS,
            989.4 * TFLOPS,
            66.9 * TFLOPS,
            80,
            3350 * GBps,
            8,
            **_NVLINK4,
            **_NDR_IB,
            source="NVIDIA H100 datasheet (SXM5): 989 TF bf16/fp16 dense (1,979 sparse), 67 TF fp32, "
            "3.35 TB/s HBM3, NVLink4 900 GB/s; ConnectX-7 400 Gb/s per GPU",
            tf32_flops=494.7 * TFLOPS,
        ),
        GpuSpec(
            "h200",
            989.4 * TFLOPS,
            989.4 * TFLOPS,
            66.9 * TFLOPS,
            141,
            4800 * GBps,
            8,
            **_NVLINK4,
            **_NDR_IB,
            source="NVIDIA H200 datasheet (SXM): 989 TF bf16/fp16 dense, 67 TF fp32, 141 GB HBM3e 4.8 TB/s, "
            "NVLink4 900 GB/s",
            tf32_flops=494.7 * TFLOPS,
        ),
        GpuSpec(
            "v100",
            0.0,
            125 * TFLOPS,
            15.7 * TFLOPS,
            31.74 * GiB / GB,
            900 * GBps,
            8,
            intra_link="nvlink2",
            intra_bw=150 * GBps,
            intra_lat=6e-6,
            nic_bw=4 * 12.5 * GBps,
            inter_lat=10e-6,
            source="NVIDIA V100 datasheet (SXM2 32GB): 125 TF fp16 tensor, 15.7 TF fp32, 900 GB/s HBM2, "
            "NVLink2 300 GB/s; no bf16; DGX-1: 4 x 100 Gb/s EDR IB per node; PyTorch reports 31.74 GiB",
        ),
        GpuSpec(
            "a40",
            149.7 * TFLOPS,
            149.7 * TFLOPS,
            37.4 * TFLOPS,
            48,
            696 * GBps,
            8,
            **_PCIE4,
            **_ETH100,
            source="NVIDIA A40 datasheet: 149.7 TF bf16/fp16 tensor dense (299.4 sparse), 37.4 TF fp32, "
            "48 GB GDDR6 696 GB/s, PCIe Gen4 x16 64 GB/s",
            tf32_flops=74.8 * TFLOPS,
            fp32_shared_datapath=True,
        ),
        GpuSpec(
            "a10",
            125 * TFLOPS,
            125 * TFLOPS,
            31.2 * TFLOPS,
            24,
            600 * GBps,
            4,
            **_PCIE4,
            **_ETH100,
            source="NVIDIA A10 datasheet: 125 TF bf16/fp16 tensor dense (250 sparse), 31.2 TF fp32, "
            "24 GB GDDR6 600 GB/s, PCIe Gen4 x16 64 GB/s",
            tf32_flops=62.5 * TFLOPS,
            fp32_shared_datapath=True,
        ),
        GpuSpec(
            "l20",
            119.5 * TFLOPS,
            119.5 * TFLOPS,
            59.8 * TFLOPS,
            48,
            864 * GBps,
            8,
            **_PCIE4,
            **_ETH100,
            source="NVIDIA L20 product brief: 119.5 TF bf16/fp16 tensor dense (239 sparse), 59.8 TF fp32, "
            "48 GB GDDR6 864 GB/s, PCIe Gen4 x16",
            fp32_shared_datapath=True,
        ),
        GpuSpec(
            "l40s",
            362.05 * TFLOPS,
            362.05 * TFLOPS,
            91.6 * TFLOPS,
            48,
            864 * GBps,
            8,
            **_PCIE4,
            **_ETH100,
            source="NVIDIA L40S datasheet: 362 TF bf16/fp16 tensor dense (733 sparse), 91.6 TF fp32, "
            "48 GB GDDR6 864 GB/s, PCIe Gen4 x16 64 GB/s",
            tf32_flops=183 * TFLOPS,
            fp32_shared_datapath=True,
        ),
        GpuSpec(
            "rtx3090",
            71 * TFLOPS,
            71 * TFLOPS,
            35.6 * TFLOPS,
            24,
            936 * GBps,
            4,
            **_PCIE4,
            **_ETH100,
            source="NVIDIA Ampere GA102 whitepaper (RTX 3090): 71 TF fp16/bf16 tensor with fp32 accumulate "
            "dense, 35.6 TF fp32, 24 GB GDDR6X 936 GB/s, PCIe Gen4",
            tf32_flops=35.6 * TFLOPS,
            fp32_shared_datapath=True,
        ),
        GpuSpec(
            "rtx4090",
            165.2 * TFLOPS,
            165.2 * TFLOPS,
            82.6 * TFLOPS,
            23.65 * GiB / GB,
            1008 * GBps,
            4,
            **_PCIE4,
            **_ETH100,
            source="NVIDIA Ada Lovelace whitepaper (RTX 4090): 165.2 TF fp16/bf16 tensor with fp32 accumulate "
            "dense, 82.6 TF fp32, 24 GB GDDR6X 1,008 GB/s, PCIe Gen4; PyTorch reports 23.65 GiB",
            tf32_flops=82.6 * TFLOPS,
            fp32_shared_datapath=True,
        ),
        # This machine's CPU: placeholder peaks of a few cores with AVX2 FMA; `calibrate.py` measures the real
        # ones. Ranks are processes, "links" are gloo over loopback shared memory.
        GpuSpec(
            "cpu",
            50 * TFLOPS / 1000,
            50 * TFLOPS / 1000,
            50 * TFLOPS / 1000,
            24,
            10 * GBps,
            4,
            intra_link="gloo-loopback",
            intra_bw=1 * GBps,
            intra_lat=50e-6,
            nic_bw=0.1 * GBps,
            inter_lat=1e-3,
            reserved_gb=4.0,
            source="placeholder; replaced by the on-device micro-profile (omni_core.measure.calibrate)",
        ),
    )
}
ALIASES = {"a100": "a100-80gb", "h100-80gb": "h100", "l40": "l40s", "3090": "rtx3090", "4090": "rtx4090"}


class GpuCatalog(Mapping[str, GpuSpec]):
    """GPU types by lower-case name (with aliases such as `a100` -> `a100-80gb`)."""

    def __init__(self, specs: Mapping[str, GpuSpec] | None = None):
        self._specs = dict(BUILTIN if specs is None else specs)

    def __getitem__(self, name: str) -> GpuSpec:
        key = name.lower()
        key = key if key in self._specs else ALIASES.get(key, key)
        if key not in self._specs:
            raise KeyError(f"unknown GPU type {name!r}; known: {', '.join(sorted(self._specs))}")
        return self._specs[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def with_overrides(self, overrides: Mapping[str, Mapping[str, Any]]) -> GpuCatalog:
        """A catalogue with types added or fields changed, e.g. {"a100": {"nic_bw": 4e11}} or a new
        type with every field; unknown fields are refused by name."""
        known = {f.name for f in fields(GpuSpec)}
        specs = dict(self._specs)
        for name, values in overrides.items():
            unknown = set(values) - known
            if unknown:
                raise ValueError(f"estimate.gpus.{name}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
            try:
                base = self[name]
                specs[base.name] = replace(base, **values)
            except KeyError:
                missing = known - set(values) - {"name", "source", "reserved_gb"}
                if missing:
                    raise ValueError(f"estimate.gpus.{name}: a new GPU type needs {sorted(missing)}") from None
                specs[name.lower()] = GpuSpec(name=name.lower(), **values)
        return GpuCatalog(specs)
