"""The estimator against published GPU training measurements (benchmarks/data/published_gpu_training.csv).

    .venv/bin/python benchmarks/estimator_gpu_bench.py [--quick] --out est_gpu.json

Each row is one measured configuration: a model shape, a global batch, a GPU type and count, the source's
parallel plan (TP x PP x DP) and its measured TFLOP/s per GPU, turned into a step time with the source's own
FLOP count. The estimator prices that plan on that Cell with the catalogue's datasheet figures and the
default `Efficiency` (no calibration: no GPU here), choosing only what the source does not state: the
micro-batch (1-8, the fastest that fits). Reported:

- `rows`: per row, predicted and measured step seconds and `log2_error` = log2(predicted / measured)
  (negative: optimistic);
- `by_gpu[type]` and `by_nodes[count]`: rows, median |log2 error|, share of rows within 1.5x, median signed
  log2 error;
- `mape_pct`, `within_1_5x_share`, `median_abs_log2`;
- `spearman_by_family[family]`: rank correlation of predicted and measured step times across a family's
  topologies (same model, different plans), or null with the reason when the table has fewer than three;
- `oom`: published out-of-memory rows refused, and feasible rows refused (none may be);
- `targets`: the issue's targets and whether each is met.
--quick prices the same rows (the cost model is fast); the keys are the same.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omni_core.common.catalog import GpuCatalog
from omni_core.common.plan import ParallelPlan
from omni_core.estimator.cost import Estimate, Options, estimate_step
from omni_core.estimator.workloads import transformer

TABLE = ROOT / "benchmarks" / "data" / "published_gpu_training.csv"
MICRO_BATCHES = (1, 2, 4, 8)
TARGETS = {"median_abs_log2_per_gpu": 0.25, "within_1_5x_share": 0.8, "spearman_per_family": 0.9}


def measured_step_s(row: dict[str, str]) -> float:
    """The row's step time from its throughput, with its source's FLOP count (Narayanan et al. 2021, eq. 3:
    forward, backward and the full recomputation of a GPT iteration, logits included)."""
    b, s, l, h, v = (int(row[k]) for k in ("global_batch", "seq_len", "layers", "hidden", "vocab"))
    flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return flops / (float(row["tflops_per_gpu"]) * 1e12 * int(row["gpus"]))


def predicted(row: dict[str, str], catalog: GpuCatalog) -> Estimate:
    """The source's plan on the row's Cell, at the micro-batch that prices fastest (the least step time, or the
    closest to fitting when none fits)."""
    workload = transformer(row["model"], n_layers=int(row["layers"]), dim=int(row["hidden"]), heads=int(row["heads"]),
                           vocab=int(row["vocab"]), seq_len=int(row["seq_len"]),
                           global_batch=int(row["global_batch"]), precision=row["precision"])
    plan = ParallelPlan(dp_replicate=int(row["dp"]), tp=int(row["tp"]), pp=int(row["pp"]))
    options = [Options(micro_batch=mb, checkpoint=row["recompute"] == "full") for mb in MICRO_BATCHES]
    estimates = [estimate_step(workload, catalog[row["gpu"]], plan, o, gpus_per_node=int(row["gpus_per_node"]))
                 for o in options]
    fitting = [e for e in estimates if e.fits]
    if fitting:
        return min(fitting, key=lambda e: e.step_time_s)
    return min(estimates, key=lambda e: e.peak_mem_bytes)


def summary(errors: list[float]) -> dict[str, float]:
    return {"rows": len(errors), "median_abs_log2": statistics.median(abs(e) for e in errors),
            "median_log2": statistics.median(errors),
            "within_1_5x_share": sum(abs(e) <= math.log2(1.5) for e in errors) / len(errors)}


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def family_spearman(rows: list[dict]) -> dict[str, dict]:
    """Per family, over models with at least three topologies: the mean rank correlation across a model's
    topologies; null with the reason when no model of the family has three."""
    out = {}
    by_family: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["measured_s"] is not None:
            by_family[r["family"]][r["model"]].append(r)
    for family, models in by_family.items():
        rhos = [spearman([r["predicted_s"] for r in rs], [r["measured_s"] for r in rs])
                for rs in models.values() if len(rs) >= 3]
        out[family] = ({"spearman": statistics.fmean(rhos), "models": len(rhos)} if rhos else
                       {"spearman": None, "why": "no model of this family has three topologies in the table"})
    return out


def run() -> dict:
    catalog = GpuCatalog()
    rows, refused_feasible, oom_rows, oom_refused = [], [], 0, 0
    for row in csv.DictReader(TABLE.open()):
        est = predicted(row, catalog)
        oom = row["tflops_per_gpu"] == "oom"
        if oom:
            oom_rows += 1
            oom_refused += not est.fits
            continue
        measured = measured_step_s(row)
        if not est.fits:
            refused_feasible.append(f"{row['model']} on {row['gpus']} {row['gpu']}: {est.reason}")
        rows.append({"source": row["source"], "model": row["model"], "family": row["family"], "gpu": row["gpu"],
                     "gpus": int(row["gpus"]), "nodes": math.ceil(int(row["gpus"]) / int(row["gpus_per_node"])),
                     "plan": est.plan.name, "micro_batch": est.options.micro_batch, "measured_s": measured,
                     "predicted_s": est.step_time_s if est.fits else None,
                     "log2_error": math.log2(est.step_time_s / measured) if est.fits else None})
    priced = [r for r in rows if r["log2_error"] is not None]
    errors = [r["log2_error"] for r in priced]
    by_gpu, by_nodes = defaultdict(list), defaultdict(list)
    for r in priced:
        by_gpu[r["gpu"]].append(r["log2_error"])
        by_nodes[r["nodes"]].append(r["log2_error"])
    overall = summary(errors)
    spear = family_spearman(priced)
    per_gpu = {g: summary(e) for g, e in sorted(by_gpu.items())}
    targets = {
        "median_abs_log2_per_gpu_le_0.25": all(s["median_abs_log2"] <= TARGETS["median_abs_log2_per_gpu"]
                                               for s in per_gpu.values()),
        "within_1_5x_share_ge_0.8": overall["within_1_5x_share"] >= TARGETS["within_1_5x_share"],
        "spearman_per_family_ge_0.9": (None if all(v["spearman"] is None for v in spear.values()) else
                                       all(v["spearman"] is None or v["spearman"] >= TARGETS["spearman_per_family"]
                                           for v in spear.values())),
        "every_published_oom_refused": oom_refused == oom_rows if oom_rows else None,
        "no_feasible_row_refused": not refused_feasible,
    }
    return {"table": str(TABLE.relative_to(ROOT)), "sources": sorted({r["source"] for r in rows}), "rows": rows,
            "by_gpu": per_gpu, "by_nodes": {n: summary(e) for n, e in sorted(by_nodes.items())},
            "mape_pct": 100 * statistics.fmean(abs(2**e - 1) for e in errors),
            "within_1_5x_share": overall["within_1_5x_share"], "median_abs_log2": overall["median_abs_log2"],
            "spearman_by_family": spear,
            "oom": {"published_oom_rows": oom_rows, "refused": oom_refused, "feasible_refused": refused_feasible},
            "targets": targets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the same rows (the cost model is fast)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    started = time.perf_counter()
    report = {"quick": args.quick, "loadavg": os.getloadavg(), **run()}
    report["seconds"] = time.perf_counter() - started
    args.out.write_text(json.dumps(report, indent=2))
    for gpu, s in report["by_gpu"].items():
        print(f"{gpu}: {s['rows']} rows, median |log2| {s['median_abs_log2']:.3f}, median log2 {s['median_log2']:+.3f}, "
              f"within 1.5x {s['within_1_5x_share']:.0%}")
    for nodes, s in report["by_nodes"].items():
        print(f"  {nodes:4d} nodes: median log2 {s['median_log2']:+.3f} ({s['rows']} rows)")
    print(f"MAPE {report['mape_pct']:.1f}%; targets: {report['targets']}")


if __name__ == "__main__":
    main()
