"""The estimator against the runtime's real steps on this machine's GPUs (issue #20's GPU validation path),
one call: calibrate the GPU type with the CUDA probes (kernels in bf16 on GPU 0; NCCL's collectives among
every visible GPU when there are two or more), stored as that type's calibration; then validate
`gpu_validation_cases` on spawned NCCL ranks, one per GPU. `benchmarks/estimator_gpu_validate.py` writes its
report.

On a machine without a GPU the same path runs on CPU ranks (the CPU validation's first quick cases, float32,
gloo), to check it and its keys; its figures are then a CPU's, not a GPU's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Literal

from omni_core.common.catalog import GpuCatalog, GpuSpec
from omni_core.measure.calibrate import calibrate
from omni_core.measure.cases import Case, gpu_validation_cases, validation_cases
from omni_core.measure.probe_device import CPU_PROBES, CUDA_PROBES, ProbeDevice
from omni_core.measure.stored_reports import validation_keys
from omni_core.measure.validate import validate

Device = Literal["cuda", "cpu"]


class UnknownGpu(ValueError):
    """This machine's GPU is not in the catalogue: its datasheet figures are needed before it is priced."""


def local_gpus() -> tuple[GpuSpec, int]:
    """The catalogue entry of this machine's GPU type and how many there are; refused by name when the
    catalogue does not know the device (add it through a recipe's `estimate.gpus`, or to the catalogue)."""
    import torch

    from omni_core.runtime.perf import catalog_gpu

    name = torch.cuda.get_device_name(0)
    spec = catalog_gpu(name)
    if spec is None:
        raise UnknownGpu(
            f"{name!r} is not in the GPU catalogue ({', '.join(GpuCatalog())}): "
            "omni_core/common/catalog.py needs its datasheet figures first"
        )
    return spec, torch.cuda.device_count()


def validation_setup(device: Device, quick: bool) -> tuple[GpuSpec, int, ProbeDevice, list[Case]]:
    """(catalogue entry, ranks, probes, cases) for `device`. quick: one-GPU cases and one per larger world; on
    CPU three short cases of the debug flavor."""
    if device == "cuda":
        spec, gpus = local_gpus()
        return spec, gpus, CUDA_PROBES, gpu_validation_cases(gpus, quick)
    cases = [c for c in validation_cases(quick=True) if c.world <= 2 and not (quick and c.flavor == "small")]
    return GpuCatalog()["cpu"], 2, CPU_PROBES, cases[: 3 if quick else None]


def gpu_validation(device: Device, quick: bool) -> dict[str, Any]:
    """Calibrate, then validate (one round when quick, else three): the CPU validation's keys (`mape_pct`,
    `mape_pct_by_world`, `n_plans_validated`, `validation_rounds`, the spreads, `validation` per case,
    `calibration` per round, which `stored_reports.repredicted` reads back), with `device`, `gpus`, `probes`
    and `device_calibration` (what the calibration measured)."""
    spec, ranks, at, cases = validation_setup(device, quick)
    world = min(ranks, max(c.world for c in cases))
    _, _, measured = calibrate(spec, world=world, repeat=1 if quick else 3, at=at)
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()  # the probes' buffers: GPU 0 is rank 0's next
    with tempfile.TemporaryDirectory(prefix="omni-gpu-validate-") as root:
        report = validate(cases, Path(root), spec, rounds=1 if quick else 3, repeat=1 if quick else 3, at=at)
    return {
        "device": spec.name,
        "gpus": ranks if device == "cuda" else 0,
        "probes": at.device,
        **validation_keys(report),
        "validation": [r.model_dump() for r in report.rows],
        "calibration": report.calibration,
        "device_calibration": measured,
        "seconds": report.seconds,
    }
