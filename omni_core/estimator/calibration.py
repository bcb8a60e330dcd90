"""The stored calibration of a device type: the catalogue entry with measured peaks and links, and the
`Efficiency` relative to it, as `omni_core.measure.calibrate` wrote it. Estimates use it whenever it exists,
so what a CellTable predicted depends on it: its digest travels with the table (`CellTable.calibrations`)
and the estimate run logs the file.

Files live under $OMNI_CALIBRATION_DIR (default ~/.cache/omni/calibration), one `<device>.json` each.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from omni_core.common.catalog import GpuSpec
from omni_core.estimator.cost import Efficiency


def calibration_dir() -> Path:
    return Path(os.environ.get("OMNI_CALIBRATION_DIR", Path.home() / ".cache" / "omni" / "calibration"))


def calibration_path(device: str) -> Path:
    return calibration_dir() / f"{device}.json"


def load_calibration(device: str) -> tuple[GpuSpec, Efficiency] | None:
    """The stored (measured spec, efficiency) of a device type, or None when it was never calibrated."""
    path = calibration_path(device)
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    eff = stored["efficiency"]
    eff["collectives"] = tuple(tuple(c) for c in eff.get("collectives", ()))
    spec = stored["spec"]
    if "inter_bw" in spec:  # stored before links across nodes were per node: it was each GPU's share of one
        spec["nic_bw"] = spec.pop("inter_bw") * spec["gpus_per_node"]
    unknown = set(spec) - {f.name for f in fields(GpuSpec)}
    if unknown:
        raise ValueError(
            f"{path}: spec.{sorted(unknown)[0]} is not a GpuSpec field; calibrate again "
            f"(python -m omni_core.measure.calibrate {device})"
        )
    return GpuSpec(**spec), Efficiency(**eff)


def calibrated(gpu: GpuSpec) -> tuple[GpuSpec, Efficiency]:
    """The stored micro-profile of this device type if there is one, else the catalogue entry and defaults."""
    return load_calibration(gpu.name) or (gpu, Efficiency())


def runtime_efficiency(eff: Efficiency) -> Efficiency:
    """What omni_core's runtime does, on top of a device's calibration: every collective is waited for
    (gloo's calls block: nothing overlaps), and the `coupled` encoders and MoE experts run replicated on each TP
    (and CP) rank."""
    return replace(
        eff,
        dp_overlap=0.0,
        tp_overlap=0.0,
        ep_overlap=0.0,
        cp_overlap=0.0,
        pp_overlap=0.0,
        split_encoders_experts=False,
    )


def calibration_digest(device: str) -> str:
    """sha256 (first 12 hex digits) of the device's stored calibration; "" when estimates use the catalogue."""
    path = calibration_path(device)
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.exists() else ""


def store_calibration(measured: GpuSpec, eff: Efficiency, raw: dict[str, Any]) -> Path:
    path = calibration_path(measured.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"device": measured.name, "spec": asdict(measured), "efficiency": asdict(eff), "raw": raw}, indent=2)
    )
    return path
