"""A recipe's jobs on its cluster -> their CellTable, plus a figure (what the estimate stage runs); and the
recipe's own run under given plans on this machine, predicted (`predicted_step_times`, for the layout benchmark).

Jobs are `recipe.jobs` (trace model names or model flavors), or, when there are none, the recipe's own
model at its own batch (micro_batch x grad_accum x nproc packed sequences). The cluster is
`cluster.node_groups`, or, when empty, `estimate.max_gpus` of each of `estimate.gpu_types`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from omni_core.common.catalog import GpuCatalog, GpuSpec
from omni_core.common.plan import ParallelPlan
from omni_core.estimator.calibration import calibrated, runtime_efficiency
from omni_core.estimator.cost import Estimate, Options, estimate_step
from omni_core.estimator.omni_workloads import omni_workload
from omni_core.estimator.search import CellTable, build_cell_table
from omni_core.estimator.trace_workloads import trace_workload
from omni_core.estimator.workloads import Workload
from omni_core.recipe.loader import RecipeError, override_recipe
from omni_core.recipe.schedule_sections import ClusterConfig, NodeGroup

if TYPE_CHECKING:
    from omni_core.common.results import TrainResult
    from omni_core.data.profile_result import DatasetProfile
    from omni_core.recipe.schema import Recipe


def flavor_workload(
    recipe: Recipe, flavor: str, batch: int, profile: DatasetProfile | None = None, name: str = "", precision: str = ""
) -> Workload:
    """A model flavor on the recipe's data (sequence length, patch size, mel bins) at `batch` packed sequences,
    in `precision` (default: the estimate's, `estimate.precision`). The recipe's own flavor is the recipe's
    model: its pretrained parts as their configs describe them (`models.pretrained.recipe_model_args`).
    The loaders leave the imbalance the profile simulated for the recipe's `data.balance` policy, `none`
    included: packing fills every sequence to seq_len, so the spread of a rank's encoder work is the packed
    sequences' (simulated), not that of its image count. Without a profile to read, balancing loaders leave
    none and plain ones an image count's spread (`encoders.unbalanced_factor`)."""
    from omni_core.models.flavors import get_flavor
    from omni_core.models.pretrained import recipe_model_args

    if flavor == recipe.model.flavor:
        args = recipe_model_args(recipe)[0]
    else:
        args = get_flavor(flavor, patch_size=recipe.data.patch_size, n_mels=recipe.data.n_mels)
    workload = omni_workload(
        args,
        seq_len=recipe.data.seq_len,
        global_batch=batch,
        profile=profile,
        name=name or flavor,
        precision=precision or recipe.estimate.precision,
    )
    policy = recipe.data.balance.policy
    simulated = profile.balance.get(policy) if profile is not None else None
    if simulated is not None:
        return replace(workload, loader_imbalance=simulated.imbalance)
    return workload if policy == "none" else replace(workload, loader_imbalance=1.0)


def recipe_batch(recipe: Recipe) -> int:
    """The recipe's own global batch in packed sequences, as the estimate prices it: micro_batch x grad_accum
    x its data shards (an explicit plan's dp; `auto`: every rank a data shard). A job re-planned while it runs
    a plan of fewer shards than ranks keeps its batch (`replan.best_overrides`)."""
    explicit = recipe.parallel.plan == "explicit"
    shards = ParallelPlan.from_config(recipe.parallel, recipe.parallel.nproc).dp if explicit else recipe.parallel.nproc
    return recipe.data.micro_batch * recipe.train.grad_accum * shards


def recipe_workloads(recipe: Recipe, profile: DatasetProfile | None = None) -> dict[str, Workload]:
    from omni_core.models.flavors import FLAVORS

    if not recipe.jobs:
        name = recipe.experiment.name
        return {name: flavor_workload(recipe, recipe.model.flavor, recipe_batch(recipe), profile, name)}
    workloads = {}
    for i, job in enumerate(recipe.jobs):
        if job.model in FLAVORS:
            workloads[job.name] = flavor_workload(recipe, job.model, job.global_batch, profile, job.name)
            continue
        try:
            workloads[job.name] = trace_workload(job.model, job.global_batch)
        except ValueError as err:
            raise ValueError(f"jobs[{i}].model: {err}; or a model flavor ({', '.join(sorted(FLAVORS))})") from None
    return workloads


def recipe_cluster(recipe: Recipe, catalog: GpuCatalog) -> tuple[dict[str, int], dict[str, int]]:
    """(GPUs per type, GPUs per node per type) of the recipe's cluster."""
    if recipe.cluster.node_groups:
        gpus: dict[str, int] = {}
        per_node: dict[str, int] = {}
        for group in recipe.cluster.node_groups:
            name = catalog[group.gpu_type].name
            gpus[name] = gpus.get(name, 0) + group.nodes * group.gpus_per_node
            per_node[name] = group.gpus_per_node
        return gpus, per_node
    return {catalog[t].name: recipe.estimate.max_gpus for t in recipe.estimate.gpu_types}, {}


def estimate_recipe(recipe: Recipe, profile: DatasetProfile | None = None, *, workers: int = 1) -> CellTable:
    catalog = GpuCatalog().with_overrides(recipe.estimate.gpus)
    gpus, per_node = recipe_cluster(recipe, catalog)
    return build_cell_table(
        recipe_workloads(recipe, profile),
        catalog,
        gpus,
        gpus_per_node=per_node,
        layout=recipe.estimate.layout,
        workers=workers,
    )


def plan_overrides(plan: ParallelPlan, micro_batch: int, checkpoint: bool, global_batch: int) -> list[str]:
    """`--set` overrides that run `plan` (its encoders' layout included) on its world with `micro_batch` and
    activation checkpointing as the estimate priced them, the gradient accumulation keeping `global_batch`
    packed sequences per step."""
    if global_batch % (micro_batch * plan.dp):
        raise ValueError(
            f"plan {plan.name} at micro-batch {micro_batch} cannot keep the global batch of "
            f"{global_batch} sequences: {micro_batch} x dp {plan.dp} does not divide it"
        )
    values = {
        "parallel.plan": "explicit",
        "parallel.nproc": plan.world_size,
        **{f"parallel.{key}": value for key, value in plan.recipe_fields().items()},
        "data.micro_batch": micro_batch,
        "train.grad_accum": global_batch // (micro_batch * plan.dp),
        "train.activation_checkpointing": checkpoint,
    }
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]  # JSON is YAML


def with_best_plan(recipe: Recipe, table: CellTable, gpu_type: str) -> Recipe:
    """`parallel.plan: auto` resolved: the recipe running the CellTable's best plan for the Cell the train stage
    has, `gpu_type` x parallel.nproc (the fastest pipeline depth), at the global batch the estimate priced."""
    job, nproc = recipe.experiment.name, recipe.parallel.nproc
    cells = table.best_cells(job)
    if (gpu_type, nproc) not in cells:
        priced = ", ".join(f"{t} x{n}" for t, n in sorted(cells)) or "none"
        raise RecipeError(
            [
                f"parallel.plan: auto, but the estimate has no Cell {gpu_type} x{nproc} for job {job!r} "
                f"(priced: {priced}; estimate.gpu_types and estimate.max_gpus choose them)"
            ]
        )
    best = cells[gpu_type, nproc]
    if best.nodes != 1:  # torchrun --standalone: the train stage's ranks are one node
        raise RecipeError(
            [
                f"parallel.plan: auto, but the estimate priced {gpu_type} x{nproc} as {best.nodes} nodes "
                f"of {best.gpus_per_node}, and the train stage runs on one node (give its size in "
                f"cluster.node_groups or estimate.gpus.{gpu_type}.gpus_per_node)"
            ]
        )
    return override_recipe(
        recipe, plan_overrides(best.parallel_plan(), best.micro_batch, best.checkpoint, recipe_batch(recipe))
    )


def estimate_own_cells(recipe: Recipe, gpu_type: str) -> CellTable:
    """The recipe's own job on this machine, one node of parallel.nproc `gpu_type`s (Cells of 1, 2, 4, ... up
    to it): what `with_best_plan` needs when the train stage runs without the estimate stage's CellTable."""
    machine = ClusterConfig(node_groups=[NodeGroup(gpu_type=gpu_type, nodes=1, gpus_per_node=recipe.parallel.nproc)])
    return estimate_recipe(recipe.model_copy(update={"jobs": [], "cluster": machine}))


def runtime_precision(recipe: Recipe, gpu: GpuSpec) -> str:
    """The precision the runtime computes in for `recipe` on `gpu` (`train.dtype`; auto: bf16 on a GPU that has
    it, else fp32, as `runtime.trainer.resolve_dtype` picks)."""
    if recipe.train.dtype == "auto":
        return "bf16" if gpu.name != "cpu" and gpu.bf16_flops else "fp32"
    return {"float32": "fp32", "bfloat16": "bf16"}[recipe.train.dtype]


def predict_plan(
    recipe: Recipe, plan: ParallelPlan, profile: DatasetProfile | None, *, gpu_type: str = "cpu"
) -> Estimate:
    """`plan`'s predicted step (time, memory) for `recipe` as the runtime trains it on one node of `gpu_type`
    (this machine by default: its stored calibration, $OMNI_CALIBRATION_DIR, with what the runtime does on top
    of it, `calibration.runtime_efficiency`): the recipe's model on the profiled data (defaults without a
    profile), in the runtime's precision, `data.micro_batch` sequences per micro-batch and `train.grad_accum`
    micro-batches per data shard (a global batch of micro_batch x grad_accum x plan.dp), checkpointing as
    `train` sets it. A plan the estimate refuses (memory, the batch split, an LSSP group) raises ValueError
    with its reason."""
    gpu, eff = calibrated(GpuCatalog().with_overrides(recipe.estimate.gpus)[gpu_type])
    eff, precision = runtime_efficiency(eff), runtime_precision(recipe, gpu)
    micro_batch, accum = recipe.data.micro_batch, recipe.train.grad_accum
    checkpointing = recipe.train.activation_checkpointing  # selective: the estimator's per-operator option
    workload = flavor_workload(recipe, recipe.model.flavor, micro_batch * accum * plan.dp, profile, precision=precision)
    est = estimate_step(
        workload,
        gpu,
        plan,
        Options(micro_batch, checkpointing != "none", "op" if checkpointing == "selective" else ""),
        gpus_per_node=plan.world_size,
        eff=eff,
    )
    if not est.fits:
        raise ValueError(f"plan {plan.name}: {est.reason}")
    return est


def predicted_step_times(
    recipe: Recipe, plans: Sequence[ParallelPlan], profile: DatasetProfile | None, *, gpu_type: str = "cpu"
) -> dict[str, float]:
    """Each plan's predicted step seconds (by plan name), as `predict_plan` prices it: what the layout
    benchmark divides (omni / coupled, disaggregated / coupled, plans of one world) and the watcher compares."""
    return {plan.name: predict_plan(recipe, plan, profile, gpu_type=gpu_type).step_time_s for plan in plans}


def prediction_error(predicted: Estimate, result: TrainResult) -> dict[str, float]:
    """A run's measured step beside the estimator's prediction for its plan. Measured memory is rank 0's peak
    (on CPU the process's resident set, which holds the runtime too, not only the model's step)."""
    return {
        "perf/predicted_step_s": predicted.step_time_s,
        "perf/measured_step_s": result.step_s,
        "estimate/error_pct": 100 * (predicted.step_time_s / result.step_s - 1),
        "perf/predicted_peak_mem_mb": predicted.peak_mem_bytes / 2**20,
        "perf/measured_peak_mem_mb": result.peak_mem_mb,
        "estimate/mem_error_pct": 100 * (predicted.peak_mem_bytes / 2**20 / result.peak_mem_mb - 1),
    }


def format_table(table: CellTable, top: int = 10) -> str:
    """Per job, its `top` Cells by throughput, then the jobs that fit nowhere."""
    lines = []
    for job in dict.fromkeys(c.job for c in table.cells):
        lines.append(f"{job}")
        lines.append(
            f"  {'gpu':<10}{'gpus':>5}{'nodes':>6}{'pp':>4}  {'plan':<36}{'mb':>3}{'ckpt':>5}"
            f"{'step s':>10}{'samples/s':>11}{'mem GB':>8}"
        )
        rows = sorted((c for c in table.cells if c.job == job), key=lambda c: -c.samples_per_s)[:top]
        lines.extend(
            f"  {c.gpu_type:<10}{c.num_gpus:>5}{c.nodes:>6}{c.pp:>4}  {c.plan:<36}{c.micro_batch:>3}"
            f"{'yes' if c.checkpoint else 'no':>5}{c.step_time_s:>10.4g}{c.samples_per_s:>11.4g}"
            f"{c.peak_mem_gb:>8.2f}"
            for c in rows
        )
    lines.extend(f"{u.job}: {u.reason}" for u in table.unfit)
    return "\n".join(lines)


def cell_figure(table: CellTable, path: Path) -> Path:
    """Predicted step time and peak memory of each job's best plan per (GPU type, GPU count)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    time_ax, mem_ax = fig.subplots(1, 2)
    best: dict[tuple[str, str, int], tuple[float, float]] = {}
    for c in table.cells:
        key = (c.job, c.gpu_type, c.num_gpus)
        if key not in best or c.step_time_s < best[key][0]:
            best[key] = (c.step_time_s, c.peak_mem_gb)
    for series in sorted({(job, gpu) for job, gpu, _ in best}):
        points = sorted((n, *best[(*series, n)]) for job, gpu, n in best if (job, gpu) == series)
        label = f"{series[0]} / {series[1]}"
        time_ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        mem_ax.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=label)
    time_ax.set(xscale="log", yscale="log", xlabel="GPUs in the Cell", ylabel="predicted step time (s)")
    mem_ax.set(xscale="log", xlabel="GPUs in the Cell", ylabel="peak memory per GPU (GB)")
    if len(best) <= 40:
        time_ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
