"""The estimator against published GPU training measurements (benchmarks/data/published_gpu_training.csv).

    .venv/bin/python benchmarks/estimator_gpu_bench.py [--quick] --out est_gpu.json

The table is priced by `omni_core.estimator.published` and the held-out check is `omni_core.estimator.arena`;
this script runs them and prints their summaries.

Each row is one measured configuration: a model shape (GPT or Llama), a global batch, a GPU type and count,
the source's parallel plan (TP x PP x CP x DP, replicated, FSDP-sharded or a ZeRO stage; interleaved pipeline
stages; gradients reduced during or after the backward), the runtime that ran it, its activation recomputation
and its measured throughput (TFLOP/s per GPU, turned into a step time with the source's own FLOP count; tokens
per second per GPU; or seconds per iteration), or that it ran out of memory. The estimator prices that plan on
that Cell with the catalogue's datasheet figures and the default `Efficiency` as the row's runtime overlaps and
allocates (`published.RUNTIMES`; no calibration: no GPU here), choosing only what the source does not state,
the fastest that fits: the micro-batch (1-8), and where a row leaves them empty the interleaved stages per rank
and the recomputation. Reported:

- `rows`: per row, predicted and measured step seconds and `log2_error` = log2(predicted / measured)
  (negative: optimistic), the plan and recomputation priced and which of them were `searched`;
- `by_gpu[type]` and `by_nodes[count]`: rows, median |log2 error|, share of rows within 1.5x, median signed
  log2 error;
- `mape_pct`, `within_1_5x_share`, `median_abs_log2`;
- `spearman_by_family[family]`: rank correlation of predicted and measured step times across a family's
  topologies (same model, different plans), or null with the reason when the table has fewer than three;
- `oom`: published out-of-memory rows refused, and feasible rows refused (none may be);
- `by_recompute[mode]`: the same summary per activation recomputation (none, full, torchtitan's
  selective-layer and selective-op, priced as `Options.selective` models them);
- `targets`: the issue's targets and whether each is met (null: not decided, e.g. the rank correlation while a
  family has no model at three topologies).

`--independent DIR` adds a held-out check (`independent`) against the Crius/Arena artifact (a checkout of
sjtu-epcc/arena, branch `ae-eurosys`, Apache-2.0; never shipped here). Its `database/prof_database.pkl` holds
Alpa's measured iteration time of the best plan it found per (model, global batch, Cell) on the Crius testbed
(HGX A100 40 GB, V100 32 GB, A40, A10; 1-16 GPUs, 1-8 nodes); the estimator's best plan for each Cell is held
against it, with the same summaries and the rank correlation across a model's Cells. Entries the database
records as failed (-1, cause not recorded) are counted with whether the estimator refuses them too. The
testbed's links are not the datasheets': its own collective measurements (`runtime/jaxpr/comm_data`) give
each GPU type's NIC bandwidth per node (`testbed_links`), which the check uses as catalogue overrides, as a
recipe's `estimate.gpus` would; `datasheet_links` is the same check with the catalogue's figures.
--quick prices the same rows (the cost model is fast); the keys are the same.
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

from omni_core.common.catalog import GpuCatalog
from omni_core.estimator.arena import independent
from omni_core.estimator.published import score

TABLE = ROOT / "benchmarks" / "data" / "published_gpu_training.csv"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the same rows (the cost model is fast)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--independent", type=Path, help="a checkout of sjtu-epcc/arena, branch ae-eurosys")
    args = parser.parse_args()
    started = time.perf_counter()
    report = {"quick": args.quick, "loadavg": os.getloadavg(), "table": str(TABLE.relative_to(ROOT)), **score(TABLE)}
    if args.independent:
        report["independent"] = independent(args.independent, GpuCatalog())
    report["seconds"] = time.perf_counter() - started
    args.out.write_text(json.dumps(report, indent=2))
    for gpu, s in report["by_gpu"].items():
        print(f"{gpu}: {s['rows']} rows, median |log2| {s['median_abs_log2']:.3f}, median log2 {s['median_log2']:+.3f}, "
              f"within 1.5x {s['within_1_5x_share']:.0%}")
    for name in ("by_nodes", "by_recompute"):
        for key, s in report[name].items():
            print(f"  {name[3:]} {key}: median log2 {s['median_log2']:+.3f} ({s['rows']} rows)")
    print(f"MAPE {report['mape_pct']:.1f}%; targets: {report['targets']}")
    held_out = report.get("independent")
    if held_out:
        print(f"independent ({held_out['source']}): {len(held_out['entries'])} entries, "
              f"median |log2| {held_out.get('median_abs_log2', float('nan')):.3f}, "
              f"within 1.5x {held_out.get('within_1_5x_share', 0):.0%}")
        for name in ("by_gpu", "by_nodes", "by_family"):
            for key, s in held_out[name].items():
                print(f"  {name[3:]} {key}: {s['rows']} rows, median log2 {s['median_log2']:+.3f}, "
                      f"median |log2| {s['median_abs_log2']:.3f}, within 1.5x {s['within_1_5x_share']:.0%}")
        print(f"  spearman: {held_out['spearman_by_family']}; refused measured: {len(held_out['refused_measured'])}; "
              f"failed entries refused: {held_out['failed_refused']}/{held_out['failed_entries']}")
        print(f"  testbed links: { {g: round(v['nic_bw'] / 1e9, 2) for g, v in held_out['testbed_links'].items()} } GB/s "
              f"per node; with the datasheets' instead: median |log2| {held_out['datasheet_links']['median_abs_log2']:.3f}")


if __name__ == "__main__":
    main()
