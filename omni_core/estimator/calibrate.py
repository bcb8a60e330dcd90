"""On-device micro-profile: a few seconds of matmuls, attention calls, memory-bound ops and collectives that
correct the catalogue's peaks for the device at hand, stored per device type.

What it measures (one process, the current thread setting, CPU tensors; collectives on local gloo ranks):

    matmul       forward + backward of [tokens x k] @ [k x n] for several shapes -> FLOP/s (median shape)
    operators    a tiny elementwise op in a loop -> the per-operator dispatch overhead
    attention    SDPA fwd + bwd per document at several lengths -> FLOP/s (longest) and per-call overhead
                 (what the shortest takes beyond that rate)
    memory       elementwise add over a large buffer -> bandwidth
    collectives  all-reduce of several sizes on `world` local ranks -> alpha (latency) and beta (bytes/s)

The result is the catalogue entry with the measured peaks and link, and an `Efficiency` relative to it
(so `cost.evaluate` is unchanged), saved as JSON under $OMNI_CALIBRATION_DIR (default ~/.cache/omni/calibration)/<device>.json. Calibration never sees
training-step times: the validation (`validate.py`) compares predictions built from it with runs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from omni_core.estimator.catalog import GpuSpec
from omni_core.estimator.cost import Efficiency

MATMUL_SHAPES = ((256, 128, 384), (512, 128, 128), (512, 384, 1536), (1024, 768, 768), (512, 768, 2048),
                 (256, 2048, 768))
ATTN_LENGTHS = (16, 64, 256, 512)
COLLECTIVE_BYTES = (4 << 10, 256 << 10, 4 << 20, 16 << 20)


def calibration_dir() -> Path:
    return Path(os.environ.get("OMNI_CALIBRATION_DIR", Path.home() / ".cache" / "omni" / "calibration"))


def load_calibration(device: str) -> tuple[GpuSpec, Efficiency] | None:
    """The stored (measured spec, efficiency) of a device type, or None when it was never calibrated."""
    path = calibration_dir() / f"{device}.json"
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    return GpuSpec(**stored["spec"]), Efficiency(**stored["efficiency"])


def _timeit(fn, repeat: int, clock=time.perf_counter) -> float:
    """Median seconds of `fn()` over `repeat` runs after one warm-up, on `clock`."""
    fn()
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope), intercept clamped at >= 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return max(0.0, my - slope * mx), slope


def _matmul_rate(repeat: int, clock) -> float:
    """Median over MATMUL_SHAPES of the FLOP/s of a matmul's forward and both backward products."""
    import torch

    torch.manual_seed(0)
    rates = []
    for m, k, n in MATMUL_SHAPES:
        a = torch.randn(m, k, requires_grad=True)
        w = torch.randn(k, n, requires_grad=True)

        def step(a=a, w=w) -> None:
            (a @ w).sum().backward()

        rates.append(6.0 * m * k * n / _timeit(step, repeat, clock))
    return statistics.median(rates)


def profile_compute(repeat: int = 5, clock=time.perf_counter) -> dict[str, float]:
    """Matmul (forward + both backward products), SDPA fwd+bwd and elementwise bandwidth, in seconds/FLOP/s."""
    import torch
    import torch.nn.functional as F

    matmul_rate = _matmul_rate(repeat, clock)

    attn_flops, attn_secs = [], []
    heads, head_dim = 8, 64
    for length in ATTN_LENGTHS:
        q, k, v = (torch.randn(heads, length, head_dim, requires_grad=True) for _ in range(3))

        def step(q=q, k=k, v=v) -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        attn_flops.append(3 * 4 * heads * head_dim * length**2 * 0.5)  # fwd + bwd, causal
        attn_secs.append(_timeit(step, repeat, clock))
    # the longest documents give the rate; what the shortest take beyond it is the per-call overhead
    attn_rate = attn_flops[-1] / attn_secs[-1]
    call_s = max(0.0, attn_secs[0] - attn_flops[0] / attn_rate) / 3  # of fwd + bwd, the forward's share

    x = torch.randn(8 << 20)
    y = torch.randn(8 << 20)
    out = torch.empty_like(x)
    mem_bw = 3 * x.numel() * 4 / _timeit(lambda: torch.add(x, y, out=out), repeat, clock)
    tiny = torch.randn(8)
    op_s = _timeit(lambda: [tiny.add(1.0) for _ in range(200)], repeat, clock) / 200
    return {"matmul_flops": matmul_rate, "attn_flops": attn_rate, "attn_call_s": call_s, "mem_bw": mem_bw, "op_s": op_s}


def _collective_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for size in COLLECTIVE_BYTES:
        buf = torch.ones(size // 4)
        dist.barrier()
        results[size] = _timeit(lambda buf=buf: dist.all_reduce(buf), 5)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def profile_collectives(world: int = 2) -> tuple[float, float]:
    """(alpha seconds per ring step, beta bytes/s per rank) of all-reduce on `world` local gloo ranks."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/collectives.json"
        mp.start_processes(_collective_worker, args=(world, port, out), nprocs=world, start_method="fork")
        times = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    # ring all-reduce: t = 2(n-1) alpha + 2(n-1)/n bytes / beta
    steps, volume = 2 * (world - 1), 2 * (world - 1) / world
    alpha_steps, inv_beta = _fit_line([volume * b for b in times], list(times.values()))
    return alpha_steps / steps, 1 / inv_beta if inv_beta > 0 else 1e9


def calibrate(spec: GpuSpec, *, world: int = 2, repeat: int = 5, save: bool = True,
              clock=time.perf_counter) -> tuple[GpuSpec, Efficiency, dict]:
    """Micro-profile this device: the catalogue entry with measured peaks and links, the Efficiency relative
    to it, and the raw measurements. Saved per device type unless `save` is false. `clock` times the compute
    kernels: wall time on a dedicated device; process CPU time on a host shared with other tenants, whose
    load would otherwise be measured instead of the device (collectives are always timed on the wall)."""
    started = time.perf_counter()
    raw = profile_compute(repeat, clock)
    alpha, beta = profile_collectives(world) if world > 1 else (spec.intra_lat, spec.intra_bw)
    raw.update(alpha_s=alpha, beta_bytes_s=beta, seconds=time.perf_counter() - started)
    peak = raw["matmul_flops"]
    measured = replace(spec, fp32_flops=peak, bf16_flops=peak, fp16_flops=peak, mem_bw=raw["mem_bw"],
                       intra_bw=beta, intra_lat=alpha)
    eff = replace(Efficiency(), matmul=1.0, attention=raw["attn_flops"] / peak, memory=1.0, link=1.0,
                  op_overhead_s=raw["op_s"], attn_call_s=raw["attn_call_s"])
    if save:
        path = calibration_dir() / f"{spec.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"device": spec.name, "spec": asdict(measured), "efficiency": asdict(eff),
                                    "raw": raw}, indent=2))
    return measured, eff, raw


if __name__ == "__main__":
    # python -m omni_core.estimator.calibrate [DEVICE]: profile this host as DEVICE (default cpu) and store it
    from omni_core.estimator.catalog import GpuCatalog

    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print(json.dumps(calibrate(GpuCatalog()[device])[2], indent=2))
    print(f"stored in {calibration_dir() / (GpuCatalog()[device].name + '.json')}")
