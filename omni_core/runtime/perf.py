"""Hardware figures for MFU and memory: the device's peak FLOP/s and this process's peak memory.

GPU peaks come from the estimator's datasheet catalogue; a CPU has no datasheet, so its peak is measured
once per process with a short matmul probe (the best of a few shapes), which is what MFU on CPU means here.
"""

from __future__ import annotations

import functools
import itertools
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

PROBE_SHAPES = (512, 1024)
LONG_ENOUGH_S = 0.05


@functools.cache
def cpu_peak_flops(dtype: torch.dtype = torch.float32, repeats: int = 3) -> float:
    """Best matmul FLOP/s over a few square shapes with this process's thread count (about a second). A shape
    whose matmul already takes LONG_ENOUGH_S is timed well enough: the larger ones are skipped (bf16 matmuls
    on a CPU without bf16 units run orders of magnitude slower than fp32, where the largest probe alone would
    take seconds)."""
    best = 0.0
    for n in PROBE_SHAPES:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm-up: allocation and kernel selection
        fastest = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            fastest = min(fastest, time.perf_counter() - start)
        best = max(best, 2 * n**3 / fastest)
        if fastest > LONG_ENOUGH_S:
            break
    return best


@dataclass(frozen=True)
class Peak:
    """What an MFU is relative to: FLOP/s and its name, e.g. "a100-80gb bf16 dense peak (datasheet)"."""

    flops: float
    name: str


def matmul_precision(device: torch.device, dtype: torch.dtype) -> str:
    """The tensor cores' precision of the step's matmuls: bf16/fp16 under autocast, fp32 as tf32 when torch is
    allowed to use TF32 (off by default for matmuls), else plain fp32."""
    if dtype in (torch.bfloat16, torch.float16):
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    return "tf32" if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32 else "fp32"


def device_peak(device: torch.device, dtype: torch.dtype) -> Peak | None:
    """The dense peak of one device at the precision its matmuls run in, named; None for a GPU the catalogue
    does not know."""
    if device.type != "cuda":
        return Peak(cpu_peak_flops(dtype), f"cpu {str(dtype).removeprefix('torch.')} matmul peak (measured here)")
    spec = catalog_gpu(torch.cuda.get_device_name(device))
    if spec is None:
        return None
    precision = matmul_precision(device, dtype)
    if precision == "tf32" and not spec.tf32_flops:
        precision = "fp32"
    return Peak(spec.peak_flops(precision), f"{spec.name} {precision} dense peak (datasheet)")


def catalog_gpu(device_name: str):
    """The catalogue entry whose name tokens all appear in a CUDA device name, most specific first:
    "NVIDIA A100-SXM4-80GB" -> a100-80gb, "NVIDIA GeForce RTX 4090" -> rtx4090, "NVIDIA H200" -> h200."""
    from omni_core.common.catalog import GpuCatalog

    words = re.split(r"[\s_-]+", device_name.lower())
    tokens = set(words) | {a + b for a, b in itertools.pairwise(words)}
    catalog = GpuCatalog()
    matches = [key for key in catalog if set(key.split("-")) <= tokens]
    return catalog[max(matches, key=lambda k: len(k.split("-")))] if matches else None


def local_device_type() -> str:
    """The catalogue name of the device this machine trains on: its first CUDA GPU's, else "cpu"."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        spec = catalog_gpu(name)
        if spec is None:
            raise ValueError(f"GPU {name!r} is not in the GPU catalogue (estimate.gpus can add it)")
        return spec.name
    return "cpu"


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak resident set on CPU: Linux's VmHWM, the high-water
    mark of this program's own memory (getrusage's ru_maxrss survives exec, so a process started by a large
    one would report its parent's size)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux and BSD report KiB
    [kib] = [line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")]
    return int(kib) / 1024
