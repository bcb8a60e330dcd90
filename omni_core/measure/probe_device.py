"""Where the kernel micro-profile runs (`ProbeDevice`), and the two devices the calibration and the validation
probe: `CPU_PROBES` (float32 at a CPU's shapes) and `CUDA_PROBES` (bf16 at shapes that reach a GPU's peaks)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omni_core.common.catalog import GpuSpec

MATMUL_SHAPES = tuple((t, k, n) for t in (32, 256, 1024) for k, n in ((64, 256), (128, 384), (384, 1536), (768, 2048)))
# (heads, head dim, document length, documents): two head sizes over the same score matrices (separating the
# per-element from the per-FLOP cost), and many short documents (the per-call cost)
ATTN_SHAPES = ((4, 16, 512, 1), (4, 64, 512, 1), (4, 32, 16, 32))
BIG_PARAM = 4 << 20  # elements of the optimizer's per-element probe
STREAM = 8 << 20  # elements of the memory bandwidth probe's buffers
# (tokens, dim, heads, kv heads, FFN width) of the element-wise probe's block: the `debug` LLM's at 512 tokens
ELEMENTWISE_BLOCK = (512, 128, 4, 2, 384)


@dataclass(frozen=True)
class ProbeDevice:
    """Where the kernel micro-profile runs: the torch device type, the compute dtype of its matmuls and
    attention, and shapes large enough for that device to reach its peaks (a GPU's kernels at a CPU's shapes
    would time their launches)."""

    device: str = "cpu"
    dtype: str = "float32"
    matmul_shapes: tuple[tuple[int, int, int], ...] = MATMUL_SHAPES
    attn_shapes: tuple[tuple[int, int, int, int], ...] = ATTN_SHAPES
    stream: int = STREAM
    big_param: int = BIG_PARAM
    elementwise_block: tuple[int, int, int, int, int] = ELEMENTWISE_BLOCK

    @property
    def element_bytes(self) -> float:
        return 2.0 if self.dtype == "bfloat16" else 4.0

    @property
    def precision(self) -> str:
        """The cost model's name for the dtype."""
        return "bf16" if self.dtype == "bfloat16" else "fp32"

    def host(self, spec: GpuSpec) -> GpuSpec:
        """`spec` as measured here: on a CPU the ranks are processes time-sharing this host's cores
        (`GpuSpec.cores`, which the cost model prices once ranks outnumber them); a GPU is one device per rank."""
        return spec if self.device == "cuda" else replace(spec, cores=os.cpu_count() or 1)

    def wall_clock(self) -> Callable[[], float]:
        """perf_counter, after the device's queued work (a GPU's kernels run asynchronously)."""
        if self.device != "cuda":
            return time.perf_counter
        import torch

        def synced() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

        return synced


CPU_PROBES = ProbeDevice()
# a GPU in bf16, as the runtime trains there: matmuls up to 8k x 8k, attention over 1k-4k documents, memory and
# the optimizer over buffers well past its caches
CUDA_PROBES = ProbeDevice(
    "cuda",
    "bfloat16",
    matmul_shapes=tuple((t, k, n) for t in (512, 2048, 8192) for k, n in ((1024, 4096), (4096, 4096), (4096, 8192))),
    attn_shapes=((16, 64, 2048, 1), (16, 128, 2048, 1), (16, 128, 128, 32)),
    stream=256 << 20,
    big_param=64 << 20,
    elementwise_block=(8192, 4096, 32, 8, 14336),
)
