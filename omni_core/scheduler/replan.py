"""Re-planning a running job when its data drifts: the watcher's one look, and the figure of a re-planned run.

A look (`look`) profiles the newest window of the job's data stream (the samples it reads next: a dynamic
source drawn at the job's step, a file source past what the job has read), compares it with the window the
running plan was chosen on (or last found best on), and only when the drift passes `replan.drift_threshold`
re-estimates the job's Cell on the new window (every look logs both predictions). The best plan over
`replan.layouts` (LLM degrees, encoder layout and LSSP, micro-batch, checkpointing) replaces the running one
only if what it is predicted to save over the remaining steps pays for the re-plan: its measured cost
(from the launcher's start to the first step, restore included, plus the last checkpoint's save) unless
`replan.cost_s` says otherwise. Both plans are priced by the same function on the same window
(`recipe_cells.predicted_step_times`), and their ratio is applied to the running launch's measured step
seconds, so gain and cost are both measured seconds whatever the estimator's absolute error. A look that does
not re-plan says why.

The job is asked to stop through its control folder (`common.control`); its launcher relaunches it under the
decision's overrides, and it resumes from that checkpoint. The data order continues where the new plan reads
the same data shards (same data-parallel degree and gradient accumulation); otherwise it restarts.
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from omni_core.common.control import (
    PROGRESS_FILE,
    STOP_FILE,
    StopRequest,
    TrainProgress,
    clear_stop,
    read_progress,
    read_stop,
)
from omni_core.common.plan import ParallelPlan
from omni_core.common.results import Result, TrainResult
from omni_core.data.dataset import open_dataset
from omni_core.data.dynamic_source import DynamicSource
from omni_core.data.flops import FlopModel
from omni_core.data.profile import data_ranks, profile_source
from omni_core.data.profile_result import DatasetProfile
from omni_core.estimator.recipe_cells import estimate_recipe, plan_overrides, predicted_step_times, recipe_batch
from omni_core.estimator.search import CellRow, PlanRow
from omni_core.recipe.loader import dump_recipe, load_recipe, override_recipe
from omni_core.recipe.schedule_sections import ClusterConfig, NodeGroup
from omni_core.recipe.schema import Recipe


class ReplanDecision(Result):
    """One look of the watcher at a running job."""

    step: int  # the job's step when it looked
    stop_step: int  # the checkpoint it would stop at
    drift: float
    mix_distance: float  # total-variation distance of the modality mix
    flops_change: float  # relative change of the mean training FLOPs per sample
    threshold: float
    running_plan: str
    best_plan: str
    predicted_running_s: float  # per step, both on the newest window
    predicted_best_s: float
    remaining_steps: int  # after stop_step
    cost_s: float
    gain_s: float  # remaining_steps x measured step seconds x (1 - predicted_best_s / predicted_running_s)
    replan: bool
    reason: str
    data_order: str  # under the best plan: "kept" (`same_data_order`) or "restarts"
    overrides: list[str]  # what runs the best plan (empty when it is the running one)

    def stop_request(self) -> StopRequest:
        return StopRequest(after_step=self.step, plan=self.best_plan, overrides=self.overrides, reason=self.reason)

    def metrics(self) -> dict[str, float]:
        return {
            "replan/drift": self.drift,
            "replan/mix_distance": self.mix_distance,
            "replan/flops_change": self.flops_change,
            "replan/predicted_running_s": self.predicted_running_s,
            "replan/predicted_best_s": self.predicted_best_s,
            "replan/cost_s": self.cost_s,
            "replan/gain_s": self.gain_s,
            "replan/decided": float(self.replan),
        }


def window_profile(recipe: Recipe, step: int, samples: int) -> DatasetProfile:
    """The `replan.window` samples the job reads after `step` steps (`samples` samples over all its ranks)."""
    cfg = recipe.data
    dataset = open_dataset(recipe)
    dynamic = isinstance(dataset.source, DynamicSource)
    flops = FlopModel.for_recipe(recipe)
    # a dynamic source follows its schedule by training step; a file source's stream goes by position
    return profile_source(
        dataset,
        cfg,
        recipe.experiment.seed,
        flops,
        recipe.replan.window,
        by_record=True,
        balance_ranks=data_ranks(recipe),
        step_batches=recipe.train.grad_accum,
        at_step=step if dynamic else 0,
        skip=0 if dynamic else samples,
    )


def drift(reference: DatasetProfile, window: DatasetProfile) -> tuple[float, float, float]:
    """(drift, mix distance, FLOPs change) of `window` against `reference`; drift is the larger of the two."""

    def share(p: DatasetProfile, kind: str) -> float:
        return p.modalities[kind].share if kind in p.modalities else 0.0

    kinds = reference.modalities.keys() | window.modalities.keys()
    mix = 0.5 * sum(abs(share(reference, k) - share(window, k)) for k in kinds)

    def per_sample(p: DatasetProfile) -> float:
        return (p.encoder_flops + p.llm_flops) / max(p.total_samples, 1)

    flops = abs(per_sample(window) / max(per_sample(reference), 1e-30) - 1)
    return max(mix, flops), mix, flops


def same_data_order(a: Recipe, b: Recipe) -> bool:
    """Whether a job resumed under `b` reads the batches it would have read under `a`: the same data shards,
    and the same sequences per step on each (balancing loaders place them per step, however they split
    into micro-batches; plain packing packs per micro-batch)."""
    per_step = a.data.micro_batch * a.train.grad_accum == b.data.micro_batch * b.train.grad_accum
    split = a.data.micro_batch == b.data.micro_batch or a.data.balance.policy != "none"
    return plan_of(a).dp == plan_of(b).dp and a.data.balance == b.data.balance and per_step and split


def plan_of(recipe: Recipe) -> ParallelPlan:
    return ParallelPlan.from_config(recipe.parallel, recipe.parallel.nproc)


def predicted_step_s(recipe: Recipe, profile: DatasetProfile, gpu_type: str) -> float:
    plan = plan_of(recipe)
    return predicted_step_times(recipe, [plan], profile, gpu_type=gpu_type)[plan.name]


def best_overrides(recipe: Recipe, profile: DatasetProfile, gpu_type: str) -> list[str]:
    """What runs the job's fastest plan for its Cell (`gpu_type` x parallel.nproc on one node) on `profile`,
    at the job's global batch: the estimate's best plans of the Cell under each of `replan.layouts` (its
    best and runners-up) priced again as the runtime trains them (`predicted_step_s`), the fastest kept."""
    machine = ClusterConfig(node_groups=[NodeGroup(gpu_type=gpu_type, nodes=1, gpus_per_node=recipe.parallel.nproc)])
    priced: list[tuple[float, list[str]]] = []
    for layout in recipe.replan.layouts:
        job = override_recipe(recipe, [f"estimate.layout={layout}"]).model_copy(update={"jobs": [], "cluster": machine})
        row = estimate_recipe(job, profile).best_cells(recipe.experiment.name).get((gpu_type, recipe.parallel.nproc))
        if row is None or row.nodes != 1:
            continue
        options: list[CellRow | PlanRow] = [row, *row.runners_up]
        for option in options:
            overrides = plan_overrides(
                ParallelPlan.parse(option.plan), option.micro_batch, option.checkpoint, recipe_batch(recipe)
            )
            try:
                priced.append((predicted_step_s(override_recipe(recipe, overrides), profile, gpu_type), overrides))
            except ValueError:
                continue  # refused as the runtime would run it
    if not priced:
        raise ValueError(
            f"the estimate fits no plan of {recipe.experiment.name!r} on {recipe.parallel.nproc} x {gpu_type}"
        )
    return min(priced, key=lambda p: p[0])[1]


def look(
    recipe: Recipe, progress: TrainProgress, reference: DatasetProfile, gpu_type: str, replans_so_far: int = 0
) -> tuple[ReplanDecision, DatasetProfile]:
    """One look at a running job (`recipe` as it runs now); returns the decision and the window it profiled."""
    cfg = recipe.replan
    window = window_profile(recipe, progress.step, progress.samples)
    distance, mix, flops = drift(reference, window)
    every = recipe.train.ckpt_every
    stop_step = min((progress.step // every + 1) * every, progress.steps)  # past a checkpoint at this step
    remaining = progress.steps - stop_step
    running_s = predicted_step_s(recipe, window, gpu_type)
    # below the threshold no search runs: the estimate is most of a look's work
    overrides = best_overrides(recipe, window, gpu_type) if distance >= cfg.drift_threshold else []
    best = override_recipe(recipe, overrides)
    best_s = predicted_step_s(best, window, gpu_type) if overrides else running_s
    cost = cfg.cost_s or progress.startup_s + progress.ckpt_s
    # the estimator's relative gain in the running launch's measured seconds, as the cost is measured
    step_s = progress.step_s if progress.step_s > 0 else running_s
    gain = remaining * step_s * (1 - best_s / running_s)
    same = (
        plan_of(best).name == plan_of(recipe).name
        and best.data.micro_batch == recipe.data.micro_batch
        and best.train.activation_checkpointing == recipe.train.activation_checkpointing
    )
    name = plan_of(best).name
    decided = False
    if distance < cfg.drift_threshold:
        reason = f"drift {distance:.3f} is below replan.drift_threshold {cfg.drift_threshold}"
    elif same:
        reason = f"the running plan {name} is still the best on the newest window"
    elif replans_so_far >= cfg.max_replans:
        reason = f"the job was re-planned {replans_so_far} times (replan.max_replans)"
    elif gain <= cost:
        reason = f"{name} would save {gain:.1f} s over the last {remaining} steps: less than a re-plan's {cost:.1f} s"
    else:
        decided = True
        reason = f"{name} saves {gain:.1f} s over the last {remaining} steps, more than a re-plan's {cost:.1f} s"
    kept = same_data_order(recipe, best)
    return ReplanDecision(
        step=progress.step,
        stop_step=stop_step,
        drift=distance,
        mix_distance=mix,
        flops_change=flops,
        threshold=cfg.drift_threshold,
        running_plan=plan_of(recipe).name,
        best_plan=name,
        predicted_running_s=running_s,
        predicted_best_s=best_s,
        remaining_steps=remaining,
        cost_s=cost,
        gain_s=gain,
        replan=decided,
        reason=reason,
        data_order="kept" if kept else "restarts",
        overrides=[] if same else overrides,
    ), window


class Segment(Result):
    """One launch of a re-planned job: its plan, its steps, its predicted and measured step seconds."""

    plan: str
    first_step: int  # steps trained before it
    last_step: int
    predicted_step_s: float
    measured_step_s: float


def replan_figure(
    segments: list[Segment], measured: list[tuple[int, float]], decisions: list[ReplanDecision], path: Path
) -> Path:
    """Step seconds over training: measured per log step, predicted per segment, re-plan points marked."""
    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    if measured:
        ax.plot(*zip(*measured), color="tab:blue", lw=1, label="measured")
    for i, seg in enumerate(segments):
        ax.hlines(
            seg.predicted_step_s,
            seg.first_step,
            seg.last_step,
            color="tab:orange",
            lw=2,
            label="predicted" if i == 0 else "_nolegend_",
        )
        ax.annotate(seg.plan, (seg.first_step, seg.predicted_step_s), fontsize=7, va="bottom")
    for d in decisions:
        ax.axvline(
            d.stop_step if d.replan else d.step, color="red" if d.replan else "0.8", ls="--" if d.replan else ":", lw=1
        )
    ax.set(xlabel="step", ylabel="seconds per step", title="re-planned run (red: re-plans, grey: looks)")
    ax.legend(fontsize=8)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


class Replanner:
    """A re-planned job's bookkeeping between its launches (the train stage launches; this decides): when to
    look, the window the running plan was chosen on, the launches and the looks so far. What a watcher
    elsewhere needs for a look of its own (`omni watch`) is kept in the control folder beside the job's
    progress: the running recipe and that window."""

    def __init__(self, recipe: Recipe, gpu_type: str, folder: Path) -> None:
        # one checkpoint directory across plans (the default one is keyed by the micro-batch and accumulation)
        self.recipe = override_recipe(recipe, [f"train.ckpt_dir={json.dumps(recipe.checkpoint_dir())}"])
        self.gpu_type, self.folder = gpu_type, folder
        self.every = recipe.replan.every_steps or recipe.train.ckpt_every
        self.reference: DatasetProfile | None = None
        # (first step, predicted step seconds) of the running launch on each window it read: its reference,
        # then every look's; a launch's prediction is their mean over its steps (`launch_predicted_s`)
        self.priced: list[tuple[int, float]] = []
        self.decisions: list[ReplanDecision] = []
        self.segments: list[Segment] = []
        self.measured: list[tuple[int, float]] = []  # (step, seconds per step) at the job's log steps
        self.next_look = 0
        self.stopping = False  # a look asked the job to stop
        self.replans = 0  # relaunches under a new plan

    def launching(self) -> Recipe:
        """The recipe of the next launch, kept in the control folder (`running_recipe`)."""
        clear_stop(self.folder)
        (self.folder / PROGRESS_FILE).unlink(missing_ok=True)
        (self.folder / RECIPE_FILE).write_text(dump_recipe(self.recipe))
        return self.recipe

    def on_progress(self, progress: TrainProgress) -> tuple[ReplanDecision, DatasetProfile] | None:
        """A new progress report of the running launch: a look (and its window) when one is due."""
        if not self.measured or self.measured[-1][0] != progress.step:
            self.measured.append((progress.step, progress.step_s))
        reference = self.reference
        if reference is None:  # the window this launch's plan runs on: where it started
            start = progress.resumed_from_step
            reference = window_profile(self.recipe, start, progress.samples * start // max(progress.step, 1))
            self.set_reference(reference, start)
            self.next_look = start + self.every
        if self.stopping or progress.step < self.next_look or progress.step >= progress.steps:
            return None
        self.next_look = progress.step + self.every
        decision, window = look(self.recipe, progress, reference, self.gpu_type, self.replans)
        self.decisions.append(decision)
        self.priced.append((progress.step, decision.predicted_running_s))
        if decision.drift >= decision.threshold and not decision.overrides:  # still the best: as if chosen on it
            self.reference = window
            window.save(self.folder / REFERENCE_FILE)
        if decision.replan:
            decision.stop_request().save(self.folder / STOP_FILE)
            self.stopping = True
        return decision, window

    def set_reference(self, window: DatasetProfile, step: int) -> None:
        self.reference = window
        window.save(self.folder / REFERENCE_FILE)
        try:
            self.priced = [(step, predicted_step_s(self.recipe, window, self.gpu_type))]
        except ValueError:  # a plan the estimate refuses on this window: the launch goes unpriced, not unwatched
            self.priced = [(step, float("nan"))]

    def launch_predicted_s(self, result: TrainResult) -> float:
        """The running launch's predicted seconds per step over the data it trained on: each window's prediction
        (its reference, then every look's) held until the next, averaged over the launch's steps. Its
        reference alone would price a drifting launch on data it left behind."""
        first, last = result.resumed_from_step, result.steps
        bounds = [(max(step, first), s) for step, s in self.priced if step < last]
        if not bounds or last <= first:
            return float("nan")
        ends = [b[0] for b in bounds[1:]] + [last]
        return sum((end - start) * s for (start, s), end in zip(bounds, ends, strict=True)) / (last - first)

    def launch_ended(self, result: TrainResult) -> bool:
        """Record a finished launch; True when it stopped because a watcher (this one or another) asked, and is
        to be relaunched under the request's plan (the recipe is then that plan's)."""
        self.segments.append(
            Segment(
                plan=result.plan,
                first_step=result.resumed_from_step,
                last_step=result.steps,
                predicted_step_s=self.launch_predicted_s(result),
                measured_step_s=result.step_s,
            )
        )
        request = read_stop(self.folder)
        self.stopping = False
        if request is None or result.steps >= self.recipe.train.steps:
            return False
        self.recipe = override_recipe(self.recipe, [*request.overrides, "train.resume=true"])
        self.replans += 1
        progress = read_progress(self.folder)
        self.set_reference(window_profile(self.recipe, result.steps, progress.samples if progress else 0), result.steps)
        self.next_look = result.steps + self.every
        return True


RECIPE_FILE = "recipe.yaml"  # the running launch's recipe
REFERENCE_FILE = "reference.json"  # the window its plan was chosen on


def control_folder(recipe: Recipe) -> Path:
    """Where a re-planned job of this experiment and its watchers meet (one such job per experiment at a time)."""
    return Path(recipe.experiment.output_dir) / recipe.experiment.name / "control"


def look_from_outside(recipe: Recipe, gpu_type: str) -> tuple[ReplanDecision, DatasetProfile]:
    """`omni watch`: one look at the running job of `recipe`'s experiment, from its control folder; a
    decision to re-plan is left there as the job's stop request."""
    folder = control_folder(recipe)
    progress = read_progress(folder)
    if progress is None or not (folder / RECIPE_FILE).is_file() or not (folder / REFERENCE_FILE).is_file():
        raise ValueError(
            f"{folder}: no re-planned job of experiment {recipe.experiment.name!r} is running "
            "(replan.enabled starts one) or it has not reported its first steps yet"
        )
    if read_stop(folder) is not None:
        raise ValueError(f"{folder}: the job is already stopping for a re-plan ({STOP_FILE})")
    running = load_recipe(folder / RECIPE_FILE)
    decision, window = look(running, progress, DatasetProfile.load(folder / REFERENCE_FILE), gpu_type)
    if decision.replan:
        decision.stop_request().save(folder / STOP_FILE)
    return decision, window
