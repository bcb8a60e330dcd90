"""The kernel micro-profile: matmuls, the runtime's attention, operator overhead, element-wise work, the
optimizer's update and memory bandwidth on one device, each probe sampled in interleaved passes and fitted to
the cost model's terms (`profile_compute`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from omni_core.measure.block_probes import elementwise_block, elementwise_bytes, tiny_block
from omni_core.measure.parameter_probes import PROBE_TENSOR_COUNTS, parameter_probes, per_group_and_tensor
from omni_core.measure.probe_device import CPU_PROBES, ProbeDevice
from omni_core.measure.sampling import Probes, count_ops, fit_costs, sample

if TYPE_CHECKING:
    import torch

COMPUTE_PASSES = 2  # interleaved passes of the kernel probes per unit of `repeat`


def kernel_probes(at: ProbeDevice = CPU_PROBES) -> Probes:
    """The kernel micro-profile's probes (`profile_compute`) on `at`'s device, forward + backward where there
    is one; built once (their buffers, models and optimizers take a second), sampled as often as needed."""
    import torch

    torch.manual_seed(0)
    dev, dtype = torch.device(at.device), getattr(torch, at.dtype)
    probes: Probes = {}
    for m, k, n in at.matmul_shapes:
        a, w = (torch.randn(r, c, device=dev, dtype=dtype, requires_grad=True) for r, c in ((m, k), (k, n)))
        probes[("matmul", m, k, n)] = _matmul(a, w)
    for heads, dim, length, docs in at.attn_shapes:
        q, key, v = (
            torch.randn(docs * length, heads, dim, device=dev, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        probes[("attention", heads, dim, length, docs)] = _attention(
            q, key, v, list(range(0, docs * length + 1, length))
        )
    probes["tiny"] = tiny_block(dev)
    probes["elementwise"] = elementwise_block(at)
    for count, update in parameter_probes(lambda n: [torch.randn(32, 32, device=dev) for _ in range(n)]).items():
        probes[("optimizer", count)] = update
    probes["update_big"] = _update_big(at, dev)
    x, y = torch.randn(at.stream, device=dev), torch.randn(at.stream, device=dev)
    out = torch.empty_like(x)
    probes["add"] = lambda: torch.add(x, y, out=out)
    return probes


def _matmul(a: torch.Tensor, w: torch.Tensor) -> Callable[[], None]:
    """Forward + backward of a @ w."""

    def run() -> None:
        (a @ w).sum().backward()

    return run


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> Callable[[], None]:
    """Forward + backward of the runtime's causal attention per document (`varlen_attention`) over `bounds`."""
    from omni_core.models.attention import varlen_attention

    def run() -> None:
        varlen_attention(q, k, v, bounds, True).sum().backward()

    return run


def _update_big(at: ProbeDevice, dev: torch.device) -> Callable[[], None]:
    """The step's clipping (norm, scaling) and AdamW over one large parameter: the update's cost per element."""
    import torch

    big = torch.nn.Parameter(torch.randn(at.big_param, device=dev))
    grad = big.grad = torch.randn(at.big_param, device=dev)
    optimizer = torch.optim.AdamW([big], lr=1e-3, foreach=True)

    def update_big() -> None:
        torch.nn.utils.get_total_norm([grad], foreach=True)
        grad.mul_(1.0)  # a scaling pass (not by < 1: repeated, it would sink the values into slow denormals)
        optimizer.step()

    return update_big


def profile_compute(
    repeat: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    probes: Probes | None = None,
    at: ProbeDevice = CPU_PROBES,
) -> dict[str, float]:
    """The device's kernels (`kernel_probes(at)`, built here unless given), fitted to the cost model's terms:

    matmul      seconds ~ FLOPs / peak + operand bytes / bandwidth (small matmuls are bound by their operands)
    attention   per document, as the runtime calls it (`varlen_attention`): seconds ~ a call's overhead + FLOPs
                / rate + score elements x seconds each (the CPU kernel materialises the full score matrix)
    operators   a tiny LLM block (all overhead) over the aten operators it dispatches: seconds per operator
    elementwise a block's element-wise operators at a model's size (`block_probes.elementwise_block`), their
                operators' overhead taken off, against the bytes the cost model counts for them: their bytes/s
    optimizer   the step's gradient norm and the runtime's AdamW at two tensor counts and over one large
                tensor: seconds per parameter group, per tensor and per element
    memory      elementwise add over a large buffer -> bandwidth

    Every probe is sampled in COMPUTE_PASSES x `repeat` interleaved passes (`sampling.sample`), a few seconds in
    all. On a GPU `clock` must wait for the device (`ProbeDevice.wall_clock`)."""
    probes = probes or kernel_probes(at)
    secs = sample(probes, COMPUTE_PASSES * repeat, clock)
    matmul_flops, matmul_bw = _matmul_rates(secs, at)
    call_s, inv_attn, score_s = fit_costs(
        [
            (docs, 3 * 4.0 * dim * heads * length**2 * docs, 3 * heads * length**2 * docs)
            for heads, dim, length, docs in at.attn_shapes
        ],
        [secs[("attention", *shape)] for shape in at.attn_shapes],
    )
    op_s = secs["tiny"] / count_ops(probes["tiny"])
    elementwise_s = secs["elementwise"] - count_ops(probes["elementwise"]) * op_s
    group_s, tensor_s = per_group_and_tensor([secs[("optimizer", n)] for n in PROBE_TENSOR_COUNTS])
    mem_bw = 3 * at.stream * 4 / secs["add"]
    return {
        "matmul_flops": matmul_flops,
        "matmul_bw": matmul_bw,
        "attn_flops": 1 / inv_attn if inv_attn else 1e30,
        "score_s": score_s,
        "attn_call_s": call_s,
        "mem_bw": mem_bw,
        "op_s": op_s,
        "tensor_s": tensor_s,
        "tensor_group_s": group_s,
        "elementwise_bw": 3 * elementwise_bytes(at) / elementwise_s if elementwise_s > 0 else 0.0,
        "optimizer_bytes_per_param": secs["update_big"] / at.big_param * mem_bw,
    }


def _matmul_rates(secs: dict[Hashable, float], at: ProbeDevice) -> tuple[float, float]:
    """(peak FLOP/s, operand bytes/s) of the matmul probes: seconds ~ FLOPs / peak + operand bytes / bandwidth
    (0 bytes/s: operands cost nothing the fit can see)."""
    size = at.element_bytes
    matmul_flops = [6.0 * m * k * n for m, k, n in at.matmul_shapes]
    matmul_s = [secs[("matmul", *shape)] for shape in at.matmul_shapes]
    inv_peak, inv_bw, _ = fit_costs(
        [(f, 3 * size * (m * k + k * n + m * n), 1.0) for f, (m, k, n) in zip(matmul_flops, at.matmul_shapes)], matmul_s
    )
    if not inv_peak:  # a loaded host's noise made the FLOP term negative: the best rate a shape reached
        inv_peak = min(t / f for t, f in zip(matmul_s, matmul_flops))
    return 1 / inv_peak, 1 / inv_bw if inv_bw else 0.0
