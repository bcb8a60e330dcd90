"""On-device micro-profile: a few seconds of kernels, runtime primitives and collectives that correct the
catalogue's peaks for the device at hand, stored per device type.

What it measures (the current thread setting, CPU tensors; never a training step), every probe sampled in
interleaved passes and averaged (`sampling.sample`: a shared host switches between fast and slow states within
a second, and a training step lasts through several):

    matmul       forward + backward of [tokens x k] @ [k x n] for several shapes -> peak FLOP/s and the
                 bandwidth of their operands (a least-squares fit of both)
    attention    the runtime's per-document attention, fwd + bwd, at several lengths and head sizes -> FLOP/s,
                 seconds per score element and per call (fitted)
    operators    a tiny LLM block, forward and backward -> seconds per aten operator it dispatches
    elementwise  a Llama block's norms, RoPE, gate and residuals at a model's size, fwd + bwd, less their operators'
                 overhead -> bytes/s of the element-wise work layers count (on a CPU they run from cache but
                 compute transcendentals element by element: slower than streaming)
    memory       elementwise add over a large buffer -> bandwidth
    on `world` forked gloo ranks (one process group on loopback):
    collectives  all-reduce, all-gather, reduce-scatter, all-to-all and a point-to-point exchange at several
                 sizes -> alpha (latency per ring step) and beta (bytes/s) of each
    memory       the elementwise add on every rank at once against rank 0 alone -> how much the ranks'
                 sharing of the node's memory bandwidth slows memory-bound work
    straggling   pieces of work each followed by an all-reduce on every rank, against the work alone -> how
                 much the ranks' independent jitter (each collective waits for the slowest) stretches a
                 rank's own work
    parameters   the step's gradient norm and the runtime's AdamW (foreach) over 8 and 64 small parameters,
                 plain (one process) and as DTensors (on the ranks), and over one large one -> seconds per
                 parameter group, per tensor and per element
    wrappers     forward + backward of stacks of small Linears under FSDP2, under DTensor TP and through a
                 1F1B pipeline, at two depths -> seconds per FSDP unit, per TP-parallel module and per
                 micro-batch per stage (hooks, redistributions, schedule, their collectives' latency)

The probes, by family: `kernels` (matmul, attention, operators, element-wise, memory; `block_probes` and
`parameter_probes` build some of them), `collective_probes`, `wrapper_probes` and `rank_probes` (the ranks);
`sampling` times and fits them, `probe_device` says where and at what shapes. The result
(`measured_efficiency`) is the catalogue entry with the measured peaks and link, and an `Efficiency` relative
to it (so `cost.estimate_step` is unchanged), saved as JSON under $OMNI_CALIBRATION_DIR (default
~/.cache/omni/calibration)/<device>.json. Calibration never sees training-step times: the validation
(`validate.py`) compares predictions built from it with runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_core.common.catalog import GpuSpec
from omni_core.estimator.calibration import calibration_path, store_calibration
from omni_core.estimator.cost import Efficiency
from omni_core.measure.collective_probes import profile_links
from omni_core.measure.kernels import profile_compute
from omni_core.measure.measured_efficiency import with_compute, with_links, with_ranks
from omni_core.measure.probe_device import CPU_PROBES, ProbeDevice
from omni_core.measure.rank_probes import profile_ranks


def calibrate(
    spec: GpuSpec,
    *,
    world: int = 2,
    repeat: int = 5,
    save: bool = True,
    clock: Callable[[], float] = time.perf_counter,
    at: ProbeDevice = CPU_PROBES,
) -> tuple[GpuSpec, Efficiency, dict[str, Any]]:
    """Micro-profile this device: the catalogue entry with measured peaks and links, the Efficiency relative
    to it, and the raw measurements. Saved per device type unless `save` is false. `clock` times a CPU's
    compute kernels: wall time on a dedicated device; process CPU time on a host shared with other tenants,
    whose load would otherwise be measured instead of the device (what ranks do together is always timed on
    the wall); a GPU's are timed on the synchronised wall clock. `world` = 1 skips the ranks (links and
    wrappers keep the catalogue's and default values); on GPUs, `world` of them measure NCCL's collectives
    and the wrappers keep their defaults. A shared host's speed drifts by tens of percent within minutes,
    and the fitted terms compensate each other within one profile: repeat whole calibrations rather than
    averaging terms (`validate.validate` profiles the kernels next to each run it compares with)."""
    started = time.perf_counter()
    gpu = at.device == "cuda"
    raw: dict[str, Any] = profile_compute(repeat, at.wall_clock() if gpu else clock, at=at)
    measured, eff = with_compute(at.host(spec), raw, at)
    if world > 1 and gpu:
        measured, eff, fits = with_links(measured, eff, profile_links(world, repeat, at)["collectives"], world)
        raw["collectives"] = {kind: {"alpha_s": a, "beta_bytes_s": b} for kind, (a, b) in fits.items()}
    elif world > 1:
        measured, eff, summary = with_ranks(measured, eff, profile_ranks(world, repeat), world)
        raw.update(summary)
    raw["seconds"] = time.perf_counter() - started
    if save:
        store_calibration(measured, eff, raw)
    return measured, eff, raw


def calibrate_into(folder: Path, world: int, device: str = "cpu") -> dict[str, Any]:
    """Calibrate this host now, stored under `folder`, and point this process's estimates (and the processes
    it starts) at it: what a benchmark comparing predictions with runs made right after uses, since a stored
    calibration drifts with a shared host's state. Returns where it is and its main figures."""
    from omni_core.common.catalog import GpuCatalog

    os.environ["OMNI_CALIBRATION_DIR"] = str(folder)
    spec, eff, raw = calibrate(GpuCatalog()[device], world=world)
    return {
        "folder": str(folder),
        "seconds": raw["seconds"],
        "fp32_flops": spec.fp32_flops,
        "op_overhead_s": eff.op_overhead_s,
        "attn_call_s": eff.attn_call_s,
        "cores": spec.cores,
    }


if __name__ == "__main__":
    # python -m omni_core.measure.calibrate [DEVICE]: profile this host as DEVICE (default cpu) and store it
    from omni_core.common.catalog import GpuCatalog

    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print(json.dumps(calibrate(GpuCatalog()[device])[2], indent=2))
    print(f"stored in {calibration_path(GpuCatalog()[device].name)}")
