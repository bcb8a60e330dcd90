"""The estimator against the runtime's real steps on this machine's GPUs (issue #20's GPU validation path).

    .venv/bin/python benchmarks/estimator_gpu_validate.py [--quick] --out est_gpu_validate.json [--device cpu]

The path is `omni_core.measure.gpu_validation`; this script runs it and writes its report.

1. Calibrate the GPU type (`omni_core.measure.calibrate` with `CUDA_PROBES`): matmuls, attention, operators,
   the optimizer and memory in bf16 on GPU 0, and NCCL's collectives among all visible GPUs when there are
   two or more; stored as that type's calibration, so every later estimate of the type uses it.
2. Validate (`omni_core.measure.validate` on spawned NCCL ranks, one per GPU, training in bf16):
   `gpu_validation_cases` (a dozen one-GPU plans, and DP / TP / PP / encoder layouts on 2 and 4 GPUs where
   there are that many), each predicted from a kernel profile taken right before its run and compared with
   the mean of its measured steps.

Keys, the same as `estimator_bench.py`'s validation: `mape_pct`, `mape_pct_by_world`, `n_plans_validated`,
`validation_rounds`, `measured_spread_pct`, `predicted_spread_pct`, `validation` (per case), `calibration`
(each round's kernels and links, which `estimator_bench.py --repredict` reads back for a CPU report), with
`device`, `gpus`, `device_calibration` (what step 1 measured) and `loadavg`.

`--device cpu` runs the same path on this host's CPU ranks where there is no GPU (the CPU validation's first
quick cases, float32, gloo), to check the script and its keys; its figures are a CPU's, not a GPU's.
--quick: one round, four one-GPU cases and one per larger world (on CPU: three short cases of the debug flavor).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omni_core.measure.gpu_validation import UnknownGpu, gpu_validation


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when a GPU is visible, else cpu (the path's check, a CPU's figures)")
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    try:
        report = {"quick": args.quick, "loadavg": os.getloadavg(), **gpu_validation(args.device, args.quick)}
    except UnknownGpu as exc:
        raise SystemExit(str(exc)) from exc
    report["total_seconds"] = time.perf_counter() - started
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k not in ("validation", "calibration", "device_calibration")},
                     indent=2))
    return report


if __name__ == "__main__":
    main()
