"""The estimator against published GPU training measurements (benchmarks/data/published_gpu_training.csv).

    .venv/bin/python benchmarks/estimator_gpu_bench.py [--quick] --out est_gpu.json

Each row is one measured configuration: a model shape (GPT or Llama), a global batch, a GPU type and count,
the source's parallel plan (TP x PP x CP x DP, replicated or FSDP-sharded; interleaved pipeline stages; gradients
reduced during or after the backward), its activation recomputation and its
measured throughput (TFLOP/s per GPU, turned into a step time with the source's own FLOP count; tokens per
second per GPU; or seconds per iteration), or that it ran out of memory. The estimator prices that plan on that Cell with the
catalogue's datasheet figures and the default `Efficiency` (no calibration: no GPU here), choosing only what
the source does not state: the micro-batch (1-8, the fastest that fits). Reported:

- `rows`: per row, predicted and measured step seconds and `log2_error` = log2(predicted / measured)
  (negative: optimistic);
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
import ast
import csv
import json
import math
import os
import pickle
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omni_core.common.catalog import GpuCatalog
from omni_core.common.plan import ParallelPlan
from omni_core.estimator.cost import Efficiency, Estimate, Options, estimate_step
from omni_core.estimator.search import best_for_gpus
from omni_core.estimator.workloads import trace_workload, transformer

TABLE = ROOT / "benchmarks" / "data" / "published_gpu_training.csv"
MICRO_BATCHES = (1, 2, 4, 8)
# the Crius testbed's devices (the artifact's runtime/jaxpr/device_info/device_infos.json): HGX A100 40 GB
ARENA_GPUS = {"a100": "a100-40gb", "v100": "v100", "a40": "a40", "a10": "a10"}
ARENA_CELL = re.compile(r"^(?P<hosts>\d+)_(?P<gpu>[a-z0-9]+)_(?P=hosts)_n_(?P<per_host>\d+)_d$")
ARENA_JOB = re.compile(r"^(?P<model>wide_resnet|bert|moe)_(?P<size>[0-9.]+[MB])_(?P<batch>\d+)$")
TARGETS = {"median_abs_log2_per_gpu": 0.25, "within_1_5x_share": 0.8, "spearman_per_family": 0.9}


# context parallelism as the table's sources ran it, PyTorch's ring attention over flash kernels, is priced as the
# runtime's Ulysses CP (the same flash kernels on 1/cp of the work; all-to-alls where the ring passes K/V): the
# runtime's own ring attention loops over fp32 tiles, which a flash kernel does not
SOURCE_CP = "ulysses"
# how the data-parallel gradients are reduced: in buckets during the backward (PyTorch DDP, FSDP, ZeRO; or not
# stated), or in one all-reduce after the last backward (Megatron-LM's "local" DDP), which hides none of it
GRAD_SYNC = ("overlapped", "after")
MEASURES = ("tflops_per_gpu", "tokens_per_s_per_gpu", "step_s", "oom")
# the row's recomputation as Options (checkpoint, selective): torchtitan's selective activation checkpointing
# keeps every second block ("layer", its default frequency 2) or a per-operator save list ("op")
RECOMPUTE = {"none": (False, ""), "full": (True, ""), "selective-layer": (True, "layer"), "selective-op": (True, "op")}


def read_table(path: Path = TABLE) -> list[dict[str, str]]:
    """The table's rows, each checked for the fields the benchmark reads (errors name the file, row and field)."""
    rows = list(csv.DictReader(path.open()))
    for line, row in enumerate(rows, start=2):
        where = f"{path.name}:{line}"
        if row["measure"] not in MEASURES:
            raise ValueError(f"{where}: measure={row['measure']!r}; known: {', '.join(MEASURES)}")
        if row["recompute"] not in RECOMPUTE:
            raise ValueError(f"{where}: recompute={row['recompute']!r}; known: {', '.join(RECOMPUTE)}")
        if row["grad_sync"] not in GRAD_SYNC:
            raise ValueError(f"{where}: grad_sync={row['grad_sync']!r}; known: {', '.join(GRAD_SYNC)}")
        if not row["vp"].isdigit() or int(row["vp"]) < 1 or int(row["layers"]) % (int(row["pp"]) * int(row["vp"])):
            raise ValueError(f"{where}: vp={row['vp']!r} must be a count of stages per rank dividing the layers per rank")
        if row["arch"] not in ("gpt", "llama"):
            raise ValueError(f"{where}: arch={row['arch']!r}; known: gpt, llama")
        if row["measure"] != "oom" and not row["value"]:
            raise ValueError(f"{where}: value is empty for measure={row['measure']}")
        if row["micro_batch"] and not (row["micro_batch"].isdigit() and int(row["micro_batch"]) > 0 and
                                       int(row["global_batch"]) % (int(row["micro_batch"]) * int(row["dp"]) * int(row["dp_shard"])) == 0):
            raise ValueError(f"{where}: micro_batch={row['micro_batch']!r} does not divide the batch per data rank")
        if row["measure"] == "tflops_per_gpu" and row["arch"] != "gpt":
            raise ValueError(f"{where}: measure=tflops_per_gpu counts FLOPs as Narayanan et al. 2021 do, for GPT rows only")
    return rows


def measured_step_s(row: dict[str, str]) -> float:
    """The row's step time from its throughput: tokens per second per GPU over the step's tokens per GPU, or
    TFLOP/s per GPU with its source's FLOP count (Narayanan et al. 2021, eq. 3: forward, backward and the full
    recomputation of a GPT iteration, logits included); or the seconds per iteration the source reports."""
    if row["measure"] == "step_s":
        return float(row["value"])
    b, s, l, h, v, gpus = (int(row[k]) for k in ("global_batch", "seq_len", "layers", "hidden", "vocab", "gpus"))
    if row["measure"] == "tokens_per_s_per_gpu":
        return b * s / (float(row["value"]) * gpus)
    flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return flops / (float(row["value"]) * 1e12 * gpus)


def row_workload(row: dict[str, str]):
    llama = row["arch"] == "llama"
    return transformer(row["model"], n_layers=int(row["layers"]), dim=int(row["hidden"]), heads=int(row["heads"]),
                       kv_heads=int(row["kv_heads"]), ffn=int(row["ffn"]), gated=llama, bias=not llama,
                       vocab=int(row["vocab"]), seq_len=int(row["seq_len"]), global_batch=int(row["global_batch"]),
                       precision=row["precision"])


def predicted(row: dict[str, str], catalog: GpuCatalog) -> Estimate:
    """The source's plan and recomputation on the row's Cell, at the micro-batch that prices fastest (the least
    step time, or the closest to fitting when none fits)."""
    workload = row_workload(row)
    vp = int(row["vp"])
    plan = ParallelPlan(dp_replicate=int(row["dp"]), dp_shard=int(row["dp_shard"]), tp=int(row["tp"]),
                        pp=int(row["pp"]), cp=int(row["cp"]), cp_kind=SOURCE_CP, virtual_stages=vp,
                        pp_schedule="Interleaved1F1B" if vp > 1 else "1F1B")
    eff = Efficiency(dp_overlap=0.0) if row["grad_sync"] == "after" else Efficiency()
    checkpoint, selective = RECOMPUTE[row["recompute"]]
    per_rank = int(row["global_batch"]) // plan.dp
    stated = (int(row["micro_batch"]),) if row["micro_batch"] else MICRO_BATCHES
    options = [Options(mb, checkpoint, selective) for mb in stated if per_rank % mb == 0]
    estimates = [estimate_step(workload, catalog[row["gpu"]], plan, o, gpus_per_node=int(row["gpus_per_node"]),
                               eff=eff) for o in options]
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
    topologies (a model at one batch and recomputation; rows without those keys are the held-out check's, one
    per Cell); null with the reason when no model of the family has three."""
    out = {}
    by_family: dict[str, dict[tuple, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["measured_s"] is not None:
            by_family[r["family"]][r["model"], r.get("global_batch"), r.get("recompute")].append(r)
    for family, models in by_family.items():
        rhos = [spearman([r["predicted_s"] for r in rs], [r["measured_s"] for r in rs])
                for rs in models.values() if len(rs) >= 3]
        out[family] = ({"spearman": statistics.fmean(rhos), "models": len(rhos)} if rhos else
                       {"spearman": None, "why": "no model of this family has three topologies in the table"})
    return out


def _every_family(spear: dict[str, dict]) -> bool | None:
    """The rank-correlation target: False where a measured family misses it, True only when every family is
    measured and meets it, None (not decided) while a family has no model at three topologies."""
    rhos = [v["spearman"] for v in spear.values()]
    if any(rho is not None and rho < TARGETS["spearman_per_family"] for rho in rhos):
        return False
    return None if None in rhos else True


class _PlainData(pickle.Unpickler):
    """Unpickles plain data only (dicts, lists, strings, numbers, numpy scalars): a third-party pickle must not
    run code."""

    SCALARS = {("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.SCALARS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name}: the artifact's tables hold plain data only")


def load_plain(path: Path):
    with path.open("rb") as f:
        return _PlainData(f).load()


def testbed_nic_bw(comm_dir: Path) -> dict[str, dict]:
    """Per GPU type, the NIC bandwidth per node its multi-node collective measurements imply: per group of
    ranks across nodes, the largest all-reduce's bus bandwidth (2(n-1)/n x bytes / seconds; a send's bytes /
    seconds when the file has no all-reduce) x the node's ranks at work in that measurement (its groups run
    at once) / the group's ranks per node (the group's share of the node's NICs, as `communication.Network`
    prices it); the median over the files of the
    InfiniBand network where the artifact measured one (`_ib`), else over the others."""
    found: dict[str, dict[bool, list[tuple[str, float]]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(comm_dir.glob("*.pkl")):
        c = ARENA_CELL.match(path.stem.removesuffix("_ib"))
        if not c or int(c["hosts"]) < 2 or c["gpu"] not in ARENA_GPUS:
            continue
        per_node, ib = int(c["per_host"]), path.stem.endswith("_ib")
        measured = {parse_kind(key, per_node): records for key, records in load_plain(path).items()}
        kinds = [k for k in measured if k[0] == "all-reduce"] or [k for k in measured if k[0] == "send"]
        for kind, groups in kinds:
            n = len(groups[0])
            nodes = len({rank // per_node for rank in groups[0]})
            if nodes < 2 or not measured[kind, groups]:
                continue
            shape, _, seconds, _ = measured[kind, groups][-1]
            nbytes = 4 * math.prod(shape)
            bus = nbytes / seconds * (2 * (n - 1) / n if kind == "all-reduce" else 1.0)
            busy = sum(rank // per_node == 0 for group in groups for rank in group)  # node 0's ranks at work
            found[ARENA_GPUS[c["gpu"]]][ib].append((path.name, bus * busy / (n / nodes)))
    links = {}
    for gpu, by_network in found.items():
        chosen = by_network[True] or by_network[False]
        links[gpu] = {"nic_bw": float(statistics.median(bw for _, bw in chosen)),
                      "files": sorted({name for name, _ in chosen})}
    return links


def parse_kind(key: str, per_node: int) -> tuple[str, tuple[tuple[int, ...], ...]]:
    """A comm_data key, "('all-reduce', [[0, 2], [1, 3]])" or "send" (rank 0 to the next node's first), as
    (kind, rank groups)."""
    if key == "send":
        return "send", ((0, per_node),)
    kind, groups = ast.literal_eval(key)
    return kind, tuple(tuple(g) for g in groups)


def arena_rows(path: Path) -> list[dict]:
    """(model, batch, GPU type, hosts, GPUs per host, measured seconds or None when it failed) per entry of the
    artifact's `optimal` table."""
    optimal = load_plain(path)["optimal"]
    rows = []
    for job, cells in optimal.items():
        j = ARENA_JOB.match(job)
        if not j:
            raise ValueError(f"{path}: optimal.{job}: not <model>_<size>_<batch>")
        for cell, seconds in cells.items():
            c = ARENA_CELL.match(cell)
            if not c or c["gpu"] not in ARENA_GPUS:
                raise ValueError(f"{path}: optimal.{job}.{cell}: not <hosts>_<gpu>_<hosts>_n_<per host>_d of "
                                 f"{sorted(ARENA_GPUS)}")
            rows.append({"model": f"{j['model']}__{j['size']}", "family": j["model"], "batch": int(j["batch"]),
                         "gpu": ARENA_GPUS[c["gpu"]], "nodes": int(c["hosts"]), "per_node": int(c["per_host"]),
                         "measured_s": float(seconds) if seconds > 0 else None})
    return rows


def independent(artifact: Path, catalog: GpuCatalog) -> dict:
    """The held-out check against the Crius/Arena artifact (module docstring), on the testbed's links and on
    the datasheets'."""
    entries = arena_rows(artifact / "database" / "prof_database.pkl")
    links = testbed_nic_bw(artifact / "runtime" / "jaxpr" / "comm_data")
    testbed = catalog.with_overrides({gpu: {"nic_bw": link["nic_bw"]} for gpu, link in links.items()})
    report = held_out(entries, testbed)
    datasheet = held_out(entries, catalog)
    return {**report, "testbed_links": links,
            "datasheet_links": {k: datasheet[k] for k in ("median_abs_log2", "within_1_5x_share", "by_gpu", "by_nodes",
                                                          "by_family", "spearman_by_family") if k in datasheet}}


def held_out(entries: list[dict], catalog: GpuCatalog) -> dict:
    rows, failed = [], []
    for entry in entries:
        gpus = entry["nodes"] * entry["per_node"]
        cell = best_for_gpus(trace_workload(entry["model"], entry["batch"]), catalog[entry["gpu"]], gpus,
                             entry["per_node"], eff=Efficiency())
        predicted_s = cell.best.step_time_s if cell else None
        if entry["measured_s"] is None:
            failed.append({**entry, "refused": cell is None})
            continue
        rows.append({**entry, "gpus": gpus, "plan": cell.best.plan.name if cell else None, "predicted_s": predicted_s,
                     "log2_error": math.log2(predicted_s / entry["measured_s"]) if cell else None})
    priced = [r for r in rows if r["log2_error"] is not None]
    groups = {"by_gpu": "gpu", "by_nodes": "nodes", "by_family": "family"}
    report = {"source": "sjtu-epcc/arena@ae-eurosys database/prof_database.pkl (optimal)", "entries": rows,
              **{name: grouped_summary(priced, key) for name, key in groups.items()},
              "spearman_by_family": family_spearman(
                  [{**r, "model": f"{r['model']}_{r['batch']}"} for r in priced]),
              "refused_measured": [f"{r['model']} b{r['batch']} on {r['nodes']}x{r['per_node']} {r['gpu']}"
                                   for r in rows if r["log2_error"] is None],
              "failed_entries": len(failed), "failed_refused": sum(f["refused"] for f in failed)}
    if priced:
        report.update(summary([r["log2_error"] for r in priced]))
    return report


def grouped_summary(rows: list[dict], key: str) -> dict:
    groups = defaultdict(list)
    for r in rows:
        groups[r[key]].append(r["log2_error"])
    return {k: summary(e) for k, e in sorted(groups.items())}


def run() -> dict:
    catalog = GpuCatalog()
    rows, refused_feasible, oom_rows, oom_refused = [], [], 0, 0
    for row in read_table():
        est = predicted(row, catalog)
        if row["measure"] == "oom":
            oom_rows += 1
            oom_refused += not est.fits
            continue
        measured = measured_step_s(row)
        if not est.fits:
            refused_feasible.append(f"{row['model']} on {row['gpus']} {row['gpu']}: {est.reason}")
        rows.append({"source": row["source"], "model": row["model"], "family": row["family"], "gpu": row["gpu"],
                     "gpus": int(row["gpus"]), "nodes": math.ceil(int(row["gpus"]) / int(row["gpus_per_node"])),
                     "plan": est.plan.name, "recompute": row["recompute"], "global_batch": int(row["global_batch"]),
                     "micro_batch": est.options.micro_batch,
                     "measured_s": measured, "predicted_s": est.step_time_s if est.fits else None,
                     "peak_gb": est.peak_mem_bytes / 1e9,
                     "log2_error": math.log2(est.step_time_s / measured) if est.fits else None})
    priced = [r for r in rows if r["log2_error"] is not None]
    errors = [r["log2_error"] for r in priced]
    overall = summary(errors)
    spear = family_spearman(priced)
    per_gpu = grouped_summary(priced, "gpu")
    targets = {
        "median_abs_log2_per_gpu_le_0.25": all(s["median_abs_log2"] <= TARGETS["median_abs_log2_per_gpu"]
                                               for s in per_gpu.values()),
        "within_1_5x_share_ge_0.8": overall["within_1_5x_share"] >= TARGETS["within_1_5x_share"],
        "spearman_per_family_ge_0.9": _every_family(spear),
        "every_published_oom_refused": oom_refused == oom_rows if oom_rows else None,
        "no_feasible_row_refused": not refused_feasible,
    }
    return {"table": str(TABLE.relative_to(ROOT)), "sources": sorted({r["source"] for r in rows}), "rows": rows,
            "by_gpu": per_gpu, "by_nodes": grouped_summary(priced, "nodes"),
            "by_recompute": grouped_summary(priced, "recompute"),
            "mape_pct": 100 * statistics.fmean(abs(2**e - 1) for e in errors),
            "within_1_5x_share": overall["within_1_5x_share"], "median_abs_log2": overall["median_abs_log2"],
            "spearman_by_family": spear,
            "oom": {"published_oom_rows": oom_rows, "refused": oom_refused, "feasible_refused": refused_feasible},
            "targets": targets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the same rows (the cost model is fast)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--independent", type=Path, help="a checkout of sjtu-epcc/arena, branch ae-eurosys")
    args = parser.parse_args()
    started = time.perf_counter()
    report = {"quick": args.quick, "loadavg": os.getloadavg(), **run()}
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
