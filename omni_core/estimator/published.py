"""The estimator against published GPU training measurements: a table of measured configurations (the shipped
one is benchmarks/data/published_gpu_training.csv, whose README names each row's source), read and checked field
by field, each row's measured step time, the source's plan priced on its Cell, and the report that
`benchmarks/estimator_gpu_bench.py` writes.

Each row is a model shape (GPT or Llama), a global batch, a GPU type and count, the source's parallel plan
(TP x PP x CP x DP, replicated, FSDP-sharded or a ZeRO stage; interleaved pipeline stages; gradients reduced
during or after the backward), the runtime that ran it, its activation recomputation and its measured
throughput (TFLOP/s per GPU, turned into a step time with the source's own FLOP count; tokens per second per
GPU; or seconds per iteration), or that it ran out of memory. The estimator prices that plan with the
catalogue's datasheet figures and the default `Efficiency` as the row's runtime overlaps and allocates
(`RUNTIMES`), choosing only what the source does not state, the fastest that fits: the micro-batch (1-8), and
where the row leaves them empty the interleaved stages per rank and the recomputation (`SEARCHED_RECOMPUTE`);
each priced row names what was chosen.
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from omni_core.common.catalog import GpuCatalog
from omni_core.common.plan import ParallelPlan, Sharding
from omni_core.estimator.accuracy import Row, family_spearman, grouped_summary, summary
from omni_core.estimator.cost import Efficiency, Estimate, Options, estimate_step
from omni_core.estimator.lm_workloads import transformer
from omni_core.estimator.workloads import Workload

TableRow = dict[str, str]  # one row of the table, as the CSV holds it

MICRO_BATCHES = (1, 2, 4, 8)
TARGETS = {"median_abs_log2_per_gpu": 0.25, "within_1_5x_share": 0.8, "spearman_per_family": 0.9}
# context parallelism as the table's sources ran it, PyTorch's ring attention over flash kernels, is priced as the
# runtime's Ulysses CP (the same flash kernels on 1/cp of the work; all-to-alls where the ring passes K/V): the
# runtime's own ring attention loops over fp32 tiles, which a flash kernel does not
SOURCE_CP: Final = "ulysses"
# how the data-parallel gradients are reduced: in buckets during the backward (PyTorch DDP, FSDP, ZeRO; or not
# stated), or in one all-reduce after the last backward (Megatron-LM's "local" DDP), which hides none of it
GRAD_SYNC = ("overlapped", "after")
MEASURES = ("tflops_per_gpu", "mcore_tflops_per_gpu", "tokens_per_s_per_gpu", "step_s", "oom")
# The runtime a row ran on, as the `Efficiency` choices that price what it overlaps and how it holds a ZeRO stage
# (the defaults are omni's runtime's: FSDP2, TP's collectives exposed):
RUNTIMES: dict[str, dict[str, Any]] = {
    # Megatron-LM as Narayanan et al. 2021 and MT-NLG ran it: TP's collectives exposed, DP as `grad_sync` says
    "megatron": {},
    # DeepSpeed's ZeRO (MT-NLG's ZeRO-1): the fp32 master copy sharded with the states, gradients reduced in
    # buckets during the backward, the parameters all-gathered after the step
    "deepspeed": {"zero_master_sharded": True, "zero_reduce_in_backward": True},
    # Megatron-Core's distributed optimizer with every overlap its README's H100 runs name: --overlap-grad-reduce,
    # --overlap-param-gather (the all-gather in the next forward), --tp-comm-overlap (TP's collectives decomposed
    # into their matmuls); gradients accumulated and reduced in bf16, its default (`grad_reduce_in_fp32` False
    # unless --accumulate-allreduce-grads-in-fp32)
    "megatron-core": {
        "grad_bytes": 2.0,
        "zero_master_sharded": True,
        "zero_reduce_in_backward": True,
        "zero_gather_in_forward": True,
        "tp_async": True,
    },
    # PyTorch's FSDP2 (torchtitan, NeMo AutoModel): omni's runtime's own choices
    "fsdp2": {},
}
# "": the dp / dp_shard columns say it (FSDP over dp_shard)
SHARDING: dict[str, Sharding] = {
    "": "fsdp",
    "fsdp": "fsdp",
    "zero2": "zero2",
    "zero1": "zero1",
    "replicate": "replicate",
}
# the recomputation tried where a row leaves it unstated: what Megatron-LM offers that the cost model prices
# (its selective recomputation of the attention core keeps nothing a flash kernel would store: as none)
SEARCHED_RECOMPUTE = ("none", "full")
# the row's recomputation as Options (checkpoint, selective): torchtitan's selective activation checkpointing
# keeps every second block ("layer", its default frequency 2) or a per-operator save list ("op")
RECOMPUTE = {"none": (False, ""), "full": (True, ""), "selective-layer": (True, "layer"), "selective-op": (True, "op")}


def read_table(path: Path) -> list[TableRow]:
    """The table's rows, each checked for the fields the check reads (errors name the file, row and field)."""
    with path.open() as table:
        rows = list(csv.DictReader(table))
    for line, row in enumerate(rows, start=2):
        problem = _row_problem(row)
        if problem:
            raise ValueError(f"{path.name}:{line}: {problem}")
    return rows


def _row_problem(row: TableRow) -> str:
    """What is wrong with one row, or ""."""
    if row["measure"] not in MEASURES:
        return f"measure={row['measure']!r}; known: {', '.join(MEASURES)}"
    if row["recompute"] and row["recompute"] not in RECOMPUTE:
        return f"recompute={row['recompute']!r}; known: {', '.join(RECOMPUTE)}, or empty (searched)"
    if row["grad_sync"] not in GRAD_SYNC:
        return f"grad_sync={row['grad_sync']!r}; known: {', '.join(GRAD_SYNC)}"
    if row["runtime"] not in RUNTIMES:
        return f"runtime={row['runtime']!r}; known: {', '.join(RUNTIMES)}"
    if row["sharding"] not in SHARDING:
        return (
            f"sharding={row['sharding']!r}; known: {', '.join(filter(None, SHARDING))}, or empty (FSDP over dp_shard)"
        )
    vp = row["vp"]
    if vp and (not vp.isdigit() or int(vp) < 1 or int(row["layers"]) % (int(row["pp"]) * int(vp))):
        return f"vp={vp!r} must be a count of stages per rank dividing the layers per rank, or empty (searched)"
    if row["arch"] not in ("gpt", "llama"):
        return f"arch={row['arch']!r}; known: gpt, llama"
    if row["measure"] != "oom" and not row["value"]:
        return f"value is empty for measure={row['measure']}"
    if row["micro_batch"] and not _micro_batch_divides(row):
        return f"micro_batch={row['micro_batch']!r} does not divide the batch per data rank"
    if row["measure"] == "tflops_per_gpu" and row["arch"] != "gpt":
        return "measure=tflops_per_gpu counts FLOPs as Narayanan et al. 2021 do, for GPT rows only"
    return ""


def _micro_batch_divides(row: TableRow) -> bool:
    per_data_rank = int(row["dp"]) * int(row["dp_shard"])
    micro_batch = row["micro_batch"]
    return (
        micro_batch.isdigit()
        and int(micro_batch) > 0
        and int(row["global_batch"]) % (int(micro_batch) * per_data_rank) == 0
    )


def measured_step_s(row: TableRow) -> float:
    """The row's step time from its throughput: tokens per second per GPU over the step's tokens per GPU, or
    TFLOP/s per GPU with its source's FLOP count (Narayanan et al. 2021, eq. 3: forward, backward and the full
    recomputation of a GPT iteration, logits included); or the seconds per iteration the source reports."""
    if row["measure"] == "step_s":
        return float(row["value"])
    b, s, layers, h, v, gpus = (int(row[k]) for k in ("global_batch", "seq_len", "layers", "hidden", "vocab", "gpus"))
    if row["measure"] == "tokens_per_s_per_gpu":
        return b * s / (float(row["value"]) * gpus)
    if row["measure"] == "mcore_tflops_per_gpu":
        flops = mcore_flops(row)
    else:
        flops = 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    return flops / (float(row["value"]) * 1e12 * gpus)


def mcore_flops(row: TableRow) -> float:
    """Megatron-Core's FLOP count of an iteration, what its logged TFLOP/s per GPU divides
    (`num_floating_point_operations` in megatron/training/training.py of NVIDIA/Megatron-LM, commit f2e5db4):
    forward and backward of the model (no recomputation), 12 B s l h^2 ((1 + g/a + s/h) + f/h x (3/2 gated) +
    V / 2lh), with g the key-value heads, a the heads, f the FFN width."""
    b, s, layers, h, v = (int(row[k]) for k in ("global_batch", "seq_len", "layers", "hidden", "vocab"))
    attention = 1 + int(row["kv_heads"]) / int(row["heads"]) + s / h
    mlp = int(row["ffn"]) / h * (1.5 if row["arch"] == "llama" else 1.0)
    return 12 * b * s * layers * h * h * (attention + mlp + v / (2 * layers * h))


def row_workload(row: TableRow) -> Workload:
    llama = row["arch"] == "llama"
    return transformer(
        row["model"],
        n_layers=int(row["layers"]),
        dim=int(row["hidden"]),
        heads=int(row["heads"]),
        kv_heads=int(row["kv_heads"]),
        ffn=int(row["ffn"]),
        gated=llama,
        bias=not llama,
        vocab=int(row["vocab"]),
        seq_len=int(row["seq_len"]),
        global_batch=int(row["global_batch"]),
        precision=row["precision"],
    )


def row_plan(row: TableRow, vp: int | None = None) -> ParallelPlan:
    """The source's parallel plan (`vp` interleaved stages per rank where the row leaves them to the search);
    interleaved 1F1B where it ran several stages per rank."""
    vp = vp or int(row["vp"])
    return ParallelPlan(
        dp_replicate=int(row["dp"]),
        dp_shard=int(row["dp_shard"]),
        tp=int(row["tp"]),
        pp=int(row["pp"]),
        cp=int(row["cp"]),
        cp_kind=SOURCE_CP,
        virtual_stages=vp,
        pp_schedule="Interleaved1F1B" if vp > 1 else "1F1B",
        sharding=SHARDING[row["sharding"]],
    )


def row_efficiency(row: TableRow) -> Efficiency:
    """The default `Efficiency` as the row's runtime overlaps and allocates (`RUNTIMES`, `grad_sync`)."""
    eff = Efficiency(dp_overlap=0.0) if row["grad_sync"] == "after" else Efficiency()
    return replace(eff, **RUNTIMES[row["runtime"]])


def row_choices(row: TableRow) -> list[tuple[ParallelPlan, Options]]:
    """Every (plan, options) the row's unstated choices allow: micro-batches 1-8 (or the stated one), interleaved
    stages per rank that divide its layers per rank (or the stated count), recomputation (or the stated one)."""
    per_stage = int(row["layers"]) // int(row["pp"])
    vps = (
        [int(row["vp"])]
        if row["vp"]
        else [v for v in range(1, 9) if per_stage % v == 0 and (v == 1 or row["pp"] != "1")]
    )
    recomputes = [row["recompute"]] if row["recompute"] else list(SEARCHED_RECOMPUTE)
    plans = [row_plan(row, vp) for vp in vps]
    per_rank = int(row["global_batch"]) // plans[0].dp
    stated = (int(row["micro_batch"]),) if row["micro_batch"] else MICRO_BATCHES
    options = [Options(mb, *RECOMPUTE[r]) for r in recomputes for mb in stated if per_rank % mb == 0]
    return [(plan, o) for plan in plans for o in options]


def predicted(row: TableRow, catalog: GpuCatalog) -> Estimate:
    """The source's plan and recomputation on the row's Cell, as the row's runtime runs it, with what the
    source leaves unstated chosen to price fastest (`row_choices`: the least step time, or the closest to
    fitting when none fits)."""
    workload, eff = row_workload(row), row_efficiency(row)
    gpu, per_node = catalog[row["gpu"]], int(row["gpus_per_node"])
    estimates = [estimate_step(workload, gpu, plan, o, gpus_per_node=per_node, eff=eff) for plan, o in row_choices(row)]
    fitting = [e for e in estimates if e.fits]
    if fitting:
        return min(fitting, key=lambda e: e.step_time_s)
    return min(estimates, key=lambda e: e.peak_mem_bytes)


def every_family_target(spear: dict[str, dict[str, Any]]) -> bool | None:
    """The rank-correlation target: False where a measured family misses it, True only when every family is
    measured and meets it, None (not decided) while a family has no model at three topologies."""
    rhos = [v["spearman"] for v in spear.values()]
    if any(rho is not None and rho < TARGETS["spearman_per_family"] for rho in rhos):
        return False
    return None if None in rhos else True


def score(table: Path, catalog: GpuCatalog | None = None) -> dict[str, Any]:
    """The table priced row by row: `rows` (predicted and measured step seconds, `log2_error` =
    log2(predicted / measured)), summaries `by_gpu`, `by_nodes`, `by_recompute`, `mape_pct`,
    `within_1_5x_share`, `median_abs_log2`, `spearman_by_family`, `oom` (published out-of-memory rows refused,
    feasible rows refused) and `targets` (each met, missed or null: not decided)."""
    catalog = catalog or GpuCatalog()
    rows: list[Row] = []
    refused_feasible: list[str] = []
    oom_rows = oom_refused = 0
    for row in read_table(table):
        est = predicted(row, catalog)
        if row["measure"] == "oom":
            oom_rows += 1
            oom_refused += not est.fits
            continue
        if not est.fits:
            refused_feasible.append(f"{row['model']} on {row['gpus']} {row['gpu']}: {est.reason}")
        rows.append(_priced_row(row, est))
    priced = [r for r in rows if r["log2_error"] is not None]
    oom = {"published_oom_rows": oom_rows, "refused": oom_refused, "feasible_refused": refused_feasible}
    return _report(rows, priced, oom)


def _priced_row(row: TableRow, est: Estimate) -> Row:
    measured = measured_step_s(row)
    return {
        "source": row["source"],
        "model": row["model"],
        "family": row["family"],
        "gpu": row["gpu"],
        "gpus": int(row["gpus"]),
        "nodes": math.ceil(int(row["gpus"]) / int(row["gpus_per_node"])),
        "plan": est.plan.name,
        "runtime": row["runtime"],
        "recompute": _recompute_name(est.options),
        "searched": [k for k in ("micro_batch", "vp", "recompute") if not row[k]],
        "global_batch": int(row["global_batch"]),
        "micro_batch": est.options.micro_batch,
        "measured_s": measured,
        "predicted_s": est.step_time_s if est.fits else None,
        "peak_gb": est.peak_mem_bytes / 1e9,
        "log2_error": math.log2(est.step_time_s / measured) if est.fits else None,
    }


def _recompute_name(options: Options) -> str:
    return next(name for name, choice in RECOMPUTE.items() if choice == (options.checkpoint, options.selective))


def _report(rows: list[Row], priced: list[Row], oom: dict[str, Any]) -> dict[str, Any]:
    errors = [r["log2_error"] for r in priced]
    overall = summary(errors)
    spear = family_spearman(priced)
    per_gpu = grouped_summary(priced, "gpu")
    targets = {
        "median_abs_log2_per_gpu_le_0.25": all(
            s["median_abs_log2"] <= TARGETS["median_abs_log2_per_gpu"] for s in per_gpu.values()
        ),
        "within_1_5x_share_ge_0.8": overall["within_1_5x_share"] >= TARGETS["within_1_5x_share"],
        "spearman_per_family_ge_0.9": every_family_target(spear),
        "every_published_oom_refused": oom["refused"] == oom["published_oom_rows"]
        if oom["published_oom_rows"]
        else None,
        "no_feasible_row_refused": not oom["feasible_refused"],
    }
    return {
        "sources": sorted({r["source"] for r in rows}),
        "rows": rows,
        "by_gpu": per_gpu,
        "by_nodes": grouped_summary(priced, "nodes"),
        "by_recompute": grouped_summary(priced, "recompute"),
        "mape_pct": 100 * statistics.fmean(abs(2**e - 1) for e in errors),
        "within_1_5x_share": overall["within_1_5x_share"],
        "median_abs_log2": overall["median_abs_log2"],
        "spearman_by_family": spear,
        "oom": oom,
        "targets": targets,
    }
