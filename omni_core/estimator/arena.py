"""A held-out check of the estimator against the Crius/Arena artifact (a checkout of sjtu-epcc/arena, branch
`ae-eurosys`, Apache-2.0; never shipped here).

Its `database/prof_database.pkl` holds Alpa's measured iteration time of the best plan it found per (model,
global batch, Cell) on the Crius testbed (HGX A100 40 GB, V100 32 GB, A40, A10; 1-16 GPUs, 1-8 nodes); the
estimator's best plan for each Cell is held against it, with `accuracy`'s summaries and the rank correlation
across a model's Cells. Entries the database records as failed (-1, cause not recorded) are counted with
whether the estimator refuses them too. The testbed's links are not the datasheets': its own collective
measurements (`runtime/jaxpr/comm_data`) give each GPU type's NIC bandwidth per node (`testbed_links`), which
the check uses as catalogue overrides, as a recipe's `estimate.gpus` would; `datasheet_links` is the same check
with the catalogue's figures. The artifact's tables are pickles: they are read as plain data only.
"""

from __future__ import annotations

import ast
import math
import pickle
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from omni_core.common.catalog import GpuCatalog
from omni_core.estimator.accuracy import Row, family_spearman, grouped_summary, summary
from omni_core.estimator.cost import Efficiency
from omni_core.estimator.search import best_for_gpus
from omni_core.estimator.trace_workloads import trace_workload

# the Crius testbed's devices (the artifact's runtime/jaxpr/device_info/device_infos.json): HGX A100 40 GB
ARENA_GPUS = {"a100": "a100-40gb", "v100": "v100", "a40": "a40", "a10": "a10"}
ARENA_CELL = re.compile(r"^(?P<hosts>\d+)_(?P<gpu>[a-z0-9]+)_(?P=hosts)_n_(?P<per_host>\d+)_d$")
ARENA_JOB = re.compile(r"^(?P<model>wide_resnet|bert|moe)_(?P<size>[0-9.]+[MB])_(?P<batch>\d+)$")
SOURCE = "sjtu-epcc/arena@ae-eurosys database/prof_database.pkl (optimal)"
RankGroups = tuple[tuple[int, ...], ...]


class _PlainData(pickle.Unpickler):
    """Unpickles plain data only (dicts, lists, strings, numbers, numpy scalars): a third-party pickle must not
    run code."""

    SCALARS = frozenset({("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"), ("numpy", "dtype")})

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.SCALARS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name}: the artifact's tables hold plain data only")


def load_plain(path: Path) -> Any:
    with path.open("rb") as f:
        return _PlainData(f).load()


def independent(artifact: Path, catalog: GpuCatalog) -> dict[str, Any]:
    """The held-out check (module docstring), on the testbed's links and on the datasheets'."""
    entries = arena_rows(artifact / "database" / "prof_database.pkl")
    links = testbed_nic_bw(artifact / "runtime" / "jaxpr" / "comm_data")
    testbed = catalog.with_overrides({gpu: {"nic_bw": link["nic_bw"]} for gpu, link in links.items()})
    report = held_out(entries, testbed)
    datasheet = held_out(entries, catalog)
    keys = ("median_abs_log2", "within_1_5x_share", "by_gpu", "by_nodes", "by_family", "spearman_by_family")
    return {**report, "testbed_links": links, "datasheet_links": {k: datasheet[k] for k in keys if k in datasheet}}


def arena_rows(path: Path) -> list[Row]:
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
                raise ValueError(
                    f"{path}: optimal.{job}.{cell}: not <hosts>_<gpu>_<hosts>_n_<per host>_d of {sorted(ARENA_GPUS)}"
                )
            rows.append({
                "model": f"{j['model']}__{j['size']}",
                "family": j["model"],
                "batch": int(j["batch"]),
                "gpu": ARENA_GPUS[c["gpu"]],
                "nodes": int(c["hosts"]),
                "per_node": int(c["per_host"]),
                "measured_s": float(seconds) if seconds > 0 else None,
            })  # fmt: skip
    return rows


def testbed_nic_bw(comm_dir: Path) -> dict[str, dict[str, Any]]:
    """Per GPU type, the NIC bandwidth per node its multi-node collective measurements imply (`_node_nic_bw`
    per file); the median over the files of the InfiniBand network where the artifact measured one (`_ib`),
    else over the others."""
    found: dict[str, dict[bool, list[tuple[str, float]]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(comm_dir.glob("*.pkl")):
        c = ARENA_CELL.match(path.stem.removesuffix("_ib"))
        if not c or int(c["hosts"]) < 2 or c["gpu"] not in ARENA_GPUS:
            continue
        bandwidths = _node_nic_bw(path, int(c["per_host"]))
        found[ARENA_GPUS[c["gpu"]]][path.stem.endswith("_ib")] += [(path.name, bw) for bw in bandwidths]
    links = {}
    for gpu, by_network in found.items():
        chosen = by_network[True] or by_network[False]
        links[gpu] = {
            "nic_bw": float(statistics.median(bw for _, bw in chosen)),
            "files": sorted({name for name, _ in chosen}),
        }
    return links


def _node_nic_bw(path: Path, per_node: int) -> list[float]:
    """Per group of ranks across nodes in one comm_data file: the largest all-reduce's bus bandwidth
    (2(n-1)/n x bytes / seconds; a send's bytes / seconds when the file has no all-reduce) x the node's ranks at
    work in that measurement (its groups run at once) / the group's ranks per node (the group's share of the
    node's NICs, as `communication.Network` prices it)."""
    measured = {parse_kind(key, per_node): records for key, records in load_plain(path).items()}
    kinds = [k for k in measured if k[0] == "all-reduce"] or [k for k in measured if k[0] == "send"]
    out = []
    for kind, groups in kinds:
        n = len(groups[0])
        nodes = len({rank // per_node for rank in groups[0]})
        if nodes < 2 or not measured[kind, groups]:
            continue
        shape, _, seconds, _ = measured[kind, groups][-1]
        nbytes = 4 * math.prod(shape)
        bus = nbytes / seconds * (2 * (n - 1) / n if kind == "all-reduce" else 1.0)
        busy = sum(rank // per_node == 0 for group in groups for rank in group)  # node 0's ranks at work
        out.append(bus * busy / (n / nodes))
    return out


def parse_kind(key: str, per_node: int) -> tuple[str, RankGroups]:
    """A comm_data key, "('all-reduce', [[0, 2], [1, 3]])" or "send" (rank 0 to the next node's first), as
    (kind, rank groups)."""
    if key == "send":
        return "send", ((0, per_node),)
    kind, groups = ast.literal_eval(key)
    return kind, tuple(tuple(g) for g in groups)


def held_out(entries: list[Row], catalog: GpuCatalog) -> dict[str, Any]:
    """The estimator's best Cell for each entry against its measurement, with the summaries per GPU type, node
    count and family; failed entries counted with whether the estimator refuses them too."""
    rows, failed = [], []
    for entry in entries:
        gpus = entry["nodes"] * entry["per_node"]
        workload = trace_workload(entry["model"], entry["batch"])
        cell = best_for_gpus(workload, catalog[entry["gpu"]], gpus, entry["per_node"], eff=Efficiency())
        best = cell.best if cell else None  # a Cell is returned only with a plan that fits
        if entry["measured_s"] is None:
            failed.append({**entry, "refused": best is None})
            continue
        rows.append({
            **entry, "gpus": gpus, "plan": best.plan.name if best else None,
            "predicted_s": best.step_time_s if best else None,
            "log2_error": math.log2(best.step_time_s / entry["measured_s"]) if best else None,
        })  # fmt: skip
    priced = [r for r in rows if r["log2_error"] is not None]
    groups = {"by_gpu": "gpu", "by_nodes": "nodes", "by_family": "family"}
    report: dict[str, Any] = {
        "source": SOURCE,
        "entries": rows,
        **{name: grouped_summary(priced, key) for name, key in groups.items()},
        "spearman_by_family": family_spearman([{**r, "model": f"{r['model']}_{r['batch']}"} for r in priced]),
        "refused_measured": [
            f"{r['model']} b{r['batch']} on {r['nodes']}x{r['per_node']} {r['gpu']}"
            for r in rows
            if r["log2_error"] is None
        ],
        "failed_entries": len(failed),
        "failed_refused": sum(f["refused"] for f in failed),
    }
    if priced:
        report.update(summary([r["log2_error"] for r in priced]))
    return report
