"""MegaScale-Omni's workloads A-D over a run whose data moves, each system deployed as it really runs: one plan
per job (for DistTrain also its encoder GPUs), its own balancing or none, every step drawn and priced under that
one deployment, the steps summed (`price_run`). The fixed-mix comparison (`layouts.compare_layouts`) gives every
layout its best plan for each mix and perfect balance; this one asks what a job pays when the mix drifts or
varies from step to step.

A step is drawn from a recipe's length distributions (`data.synthetic`: image sides, text document lengths) at
the trajectory's image share of the LLM's tokens (`drift_shares`, `stationary_shares`): documents are drawn and
packed in order into the step's sequences of the workload's seq_len, so images per sequence, their patches and
the longest image move from step to step. Each system's balancing then sets the slowest rank's encoder work
(`SYSTEMS`; `step_workload`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from omni_core.common.catalog import GpuSpec
from omni_core.common.plan import EncoderLayout, ParallelPlan
from omni_core.data.image import patch_grid
from omni_core.data.sample import KIND_CODE
from omni_core.data.workload import MixSchedule, draw_lengths
from omni_core.estimator.cost import Efficiency, Estimate, Options, estimate_step
from omni_core.estimator.orchestration import pipeline_depths
from omni_core.estimator.paper_workloads import MERGE, PAPER_WORKLOADS, SequenceMix, mix_workload, paper_args
from omni_core.estimator.search import search_cell
from omni_core.estimator.workloads import Workload
from omni_core.recipe.data_sections import DataConfig, SyntheticConfig

Balance = Literal["none", "reorder", "grouped"]
ChosenOn = Literal["first_window", "run_average"]


@dataclass(frozen=True)
class System:
    """How a system runs a job: where its encoders go, how it balances a step, and on what data its one plan
    (and encoder split) is chosen."""

    layout: EncoderLayout
    balance: Balance
    chosen_on: ChosenOn
    source: str  # where the paper (or code) says so


SYSTEMS = {
    # Megatron-LM (Megatron-LLaVA's layout): the parallel sizes are launch arguments, fixed for the job, tuned
    # by its user on a short trial run at the start; its samplers hand each data-parallel rank consecutive
    # samples, with no rebalancing, so a step waits for the rank that drew the most encoder work.
    "megatron": System(
        "coupled", "none", "first_window", "Megatron-LM: --*-model-parallel-size launch arguments; sequential sampler"
    ),
    # DistTrain (Zhang et al., SIGCOMM'25, arXiv 2408.04275): 'disaggregated model orchestration' sizes the
    # encoder's and the LLM's GPUs and parallelism once, before training, from the profiled training data (its
    # average); 'disaggregated data preprocessing' reorders samples so the encoder work is balanced over the
    # encoder's data-parallel ranks (intra-microbatch reordering).
    "disttrain": System(
        "disaggregated", "reorder", "run_average", "DistTrain: model orchestration before training; data reordering"
    ),
    # MegaScale-Omni (DESIGN.md 3): one plan per job; each step's items balanced by decentralized grouped
    # reordering and the longest split by LSSP, both priced in the `omni` layout's own term.
    "omni": System("omni", "grouped", "first_window", "MegaScale-Omni: grouped reordering and LSSP per step"),
}


# --- trajectories and draws ----------------------------------------------------------------------------------


def image_share(shares: np.ndarray, schedule: MixSchedule) -> np.ndarray:
    """image / (image + text) of a schedule's modality shares (the paper's workloads have no audio or video)."""
    image, text = shares[..., KIND_CODE["image"]], shares[..., KIND_CODE["text"]]
    return image / np.maximum(image + text, 1e-12)


def drift_shares(syn: SyntheticConfig, steps: int, horizon: int) -> np.ndarray:
    """Image share of the LLM's tokens at each of `steps` steps along `syn.schedule`, whose `horizon` steps are
    stretched over the run (the paper's mixes are token shares: the schedule's image:text is read as one)."""
    if not syn.schedule:
        raise ValueError("data.synthetic.schedule is empty: a drift needs a mix schedule")
    schedule = MixSchedule(syn.model_copy(update={"bursts": []}))
    return image_share(schedule.at(np.arange(steps) * horizon / steps), schedule)


def stationary_shares(syn: SyntheticConfig, steps: int) -> np.ndarray:
    """The stationary `mix`'s image share at every step: only the draws vary."""
    schedule = MixSchedule(syn.model_copy(update={"schedule": [], "bursts": []}))
    return np.full(steps, float(image_share(schedule.at(0), schedule)))


@dataclass(frozen=True)
class StepDraw:
    """One step's sequences as drawn: per sequence its images, their patches and squares, its text documents
    and their squared lengths; per image its patches and its sequence."""

    images: np.ndarray
    patches: np.ndarray
    patches_sq: np.ndarray
    text_docs: np.ndarray
    text_sq: np.ndarray
    image_patches: np.ndarray
    image_sequence: np.ndarray


@dataclass
class Drawer:
    """Draws steps of `batch` sequences of `seq_len` tokens from `data`'s length distributions."""

    data: DataConfig
    seq_len: int
    batch: int
    seed: int = 0
    means: tuple[float, float] = field(init=False)  # LLM tokens of a mean image and of a mean text document

    def __post_init__(self) -> None:
        rng = np.random.default_rng([self.seed, 2**31])
        image, text = self._lengths(rng, 20_000)
        self.means = (float(image.mean()) / MERGE, float(text.mean()))

    def _lengths(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(patches of n images, tokens of n text documents, none over seq_len)."""
        syn, cfg = self.data.synthetic, self.data
        sides = [draw_lengths(syn.image_side_px, rng.random(n), rng.random(n)) for _ in range(2)]
        rows, cols = patch_grid(sides[0], sides[1], cfg.patch_size, cfg.max_image_patches, cfg.min_image_patches)
        short = syn.text_tokens
        if short is None:
            raise ValueError("data.synthetic.text_tokens is unset: the draw needs a text length distribution")
        long_doc = rng.random(n) < syn.long_doc_share
        text = np.where(
            long_doc,
            draw_lengths(syn.long_doc_tokens, rng.random(n), rng.random(n)),
            draw_lengths(short, rng.random(n), rng.random(n)),
        )
        return (rows * cols).astype(np.float64), np.minimum(text, self.seq_len).astype(np.float64)

    def draw(self, step: int, share: float) -> StepDraw:
        """Step `step` at image share `share`: documents drawn (an image with the probability that gives the
        share of tokens in expectation) and packed in order, each into the sequence its first token falls in."""
        rng = np.random.default_rng([self.seed, step])
        image_mean, text_mean = self.means
        p_image = share / image_mean / (share / image_mean + (1 - share) / text_mean) if share < 1 else 1.0
        total = self.seq_len * self.batch
        n = math.ceil(1.2 * total / (p_image * image_mean + (1 - p_image) * text_mean)) + 64
        patches, text = self._lengths(rng, n)
        is_image = rng.random(n) < p_image
        tokens = np.where(is_image, patches / MERGE, text)
        starts = np.cumsum(tokens) - tokens
        keep = starts < total
        sequence = (starts[keep] // self.seq_len).astype(np.int64)
        is_image, patches, text = is_image[keep], patches[keep], text[keep]
        per = self.batch

        def count(weights: np.ndarray) -> np.ndarray:
            return np.bincount(sequence, weights, minlength=per)[:per]

        img = is_image.astype(np.float64)
        images, image_patches = count(img), count(patches * img)
        text_tokens, text_docs, text_sq = count(text * ~is_image), count(1.0 - img), count(text**2 * ~is_image)
        # the text fills what the images leave: its documents and squares scale with it
        room = np.maximum(self.seq_len - image_patches / MERGE, 0.0)
        scale = np.where(text_tokens > 0, room / np.maximum(text_tokens, 1.0), 0.0)
        return StepDraw(
            images,
            image_patches,
            count((patches**2) * img),
            text_docs * scale,
            text_sq * scale,
            patches[is_image],
            sequence[is_image],
        )


# --- a step under a system -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkModel:
    """An image's encoder work as a + b * patches (linear layers, per patch) + c * patches^2 (attention), from
    workload `key`'s ViT and projector: what the balancing policies weigh."""

    linear: float
    quadratic: float

    @classmethod
    def of(cls, key: str) -> WorkModel:
        reference = SequenceMix.fixed(0.5, PAPER_WORKLOADS[key][2])
        encoder = mix_workload(key, reference, "reference").encoder
        return cls(
            sum(layer.flops for layer in encoder) / reference.patches,
            sum(layer.attn_flops for layer in encoder) / reference.patches_sq,
        )

    def of_images(self, patches: np.ndarray) -> np.ndarray:
        return self.linear * patches + self.quadratic * patches**2


def sequence_mix(draw: StepDraw, work: WorkModel) -> SequenceMix:
    """The step's mean sequence, its longest image and the spread of encoder work over its sequences."""
    per_sequence = work.linear * draw.patches + work.quadratic * draw.patches_sq
    mean = float(per_sequence.mean())
    return SequenceMix(
        float(draw.images.mean()),
        float(draw.patches.mean()),
        float(draw.patches_sq.mean()),
        float(draw.text_docs.mean()),
        float(draw.text_sq.mean()),
        longest_image=float(draw.image_patches.max()) if len(draw.image_patches) else 0.0,
        encoder_cv=float(per_sequence.std() / mean) if mean else 0.0,
    )


def max_over_mean(loads: np.ndarray) -> float:
    mean = float(loads.mean())
    return float(loads.max()) / mean if mean else 1.0


def in_order_imbalance(draw: StepDraw, work: WorkModel, ranks: int, llm_per_sequence: float = 0.0) -> float:
    """Max / mean of the whole work (encoders, and the LLM's `llm_per_sequence` FLOPs a sequence) over `ranks`
    data-parallel ranks that take the step's sequences in order, a contiguous block each (no rebalancing): the
    figure the profile simulates for unbalanced loaders, which the busiest rank pays on both."""
    per_sequence = work.linear * draw.patches + work.quadratic * draw.patches_sq + llm_per_sequence
    return max_over_mean(per_sequence.reshape(ranks, -1).sum(axis=1))


def reordered_imbalance(draw: StepDraw, work: WorkModel, ranks: int) -> float:
    """Max / mean encoder work over `ranks` encoder ranks after longest-processing-time assignment of the
    step's images, `ranks` at a time: each round's largest images go to the least loaded ranks."""
    items = np.sort(work.of_images(draw.image_patches))[::-1]
    if not len(items) or ranks == 1:
        return 1.0
    loads = np.zeros(ranks)
    for start in range(0, len(items), ranks):
        chunk = items[start : start + ranks]
        loads[np.argsort(loads)[: len(chunk)]] += chunk
    return max_over_mean(loads)


def step_workload(base: Workload, draw: StepDraw, work: WorkModel, system: System, plan: ParallelPlan) -> Workload:
    """The step's workload as `system` leaves its ranks' encoder work under `plan`: Megatron-LM's slowest data
    rank, DistTrain's slowest encoder rank after reordering; MegaScale-Omni's in its own term (a rank's
    balanced share or the longest image). The memoised sums do not depend on these: the cache is shared."""
    if system.balance == "none":
        llm = sum(layer.flops + layer.attn_flops for layer in base.llm)
        return replace(base, loader_imbalance=in_order_imbalance(draw, work, plan.dp, llm), cache=base.cache)
    if system.balance == "reorder":
        return replace(base, encoder_imbalance=reordered_imbalance(draw, work, plan.encoders.ranks), cache=base.cache)
    return base


# --- deployment and the run --------------------------------------------------------------------------------


def mean_mix(mixes: list[SequenceMix]) -> SequenceMix:
    """The mean sequence over steps (their longest image the longest of all): what a plan is chosen on."""
    n = len(mixes)
    return SequenceMix(
        sum(m.images for m in mixes) / n,
        sum(m.patches for m in mixes) / n,
        sum(m.patches_sq for m in mixes) / n,
        sum(m.text_docs for m in mixes) / n,
        sum(m.text_sq for m in mixes) / n,
        longest_image=max(m.longest_image for m in mixes),
        encoder_cv=sum(m.encoder_cv or 0.0 for m in mixes) / n,
    )


def first_window(mixes: list[SequenceMix], batch: int, samples: int) -> int:
    """Steps whose documents make up the first `samples` (`data.profile_window`: what a profile at the start
    reads), at least one."""
    seen = 0.0
    for step, mix in enumerate(mixes, start=1):
        seen += (mix.images + mix.text_docs) * batch
        if seen >= samples:
            return step
    return len(mixes)


def encoder_heaviness(workload: Workload) -> float:
    """A step's encoder activations, what varies in memory from step to step: the heaviest steps are the
    likeliest not to fit."""
    return sum(layer.act_bytes for layer in workload.encoder)


def ranked_plans(
    workload: Workload,
    gpu: GpuSpec,
    num_gpus: int,
    eff: Efficiency,
    layout: EncoderLayout,
    heaviest: Workload | None = None,
) -> list[Estimate]:
    """The layout's fastest plans on `workload` over pipeline depths (each Cell's best and runners-up), each
    also with activation checkpointing, fastest first: what a system picks from, in order. With the run's
    `heaviest` step, also the plans its own search finds (they fit it), priced on `workload`: the Cells keep
    a few plans, one encoder half each, all fastest on `workload`, so where those need more memory than the
    heaviest step leaves, the plans that fit it would otherwise never be candidates."""
    per_node = min(num_gpus, 8)
    found: list[Estimate] = []
    for pp in pipeline_depths(workload, num_gpus, layout):
        cell = search_cell(workload, gpu, num_gpus, per_node, pp, eff=eff, layout=layout)
        found += [cell.best, *cell.runners_up] if cell.best else []
    found += [
        estimate_step(workload, gpu, e.plan, Options(e.options.micro_batch, True), gpus_per_node=per_node, eff=eff)
        for e in found
        if not e.options.checkpoint
    ]
    if heaviest is not None:
        found += [
            estimate_step(workload, gpu, e.plan, e.options, gpus_per_node=per_node, eff=eff)
            for e in ranked_plans(heaviest, gpu, num_gpus, eff, layout)
        ]
    unique = {(e.plan.name, e.options.micro_batch, e.options.checkpoint): e for e in found if e.fits}
    return sorted(unique.values(), key=lambda e: e.step_time_s)


def first_fitting(
    ranked: list[Estimate],
    steps: list[Workload],
    gpu: GpuSpec,
    eff: Efficiency,
) -> tuple[Estimate | None, list[str]]:
    """The first of `ranked` that fits memory at every step (tried heaviest encoder step first), and why each
    one before it did not: a job cannot change its plan when a later step needs more memory."""
    order = sorted(steps, key=lambda w: -encoder_heaviness(w))
    refused: list[str] = []
    for est in ranked:
        per_node = min(est.plan.world_size, 8)
        failure = next(
            (
                (w.name, e.reason)
                for w in order
                if not (e := estimate_step(w, gpu, est.plan, est.options, gpus_per_node=per_node, eff=eff)).fits
            ),
            None,
        )
        if failure is None:
            return est, refused
        refused.append(
            f"{est.plan.name} mb{est.options.micro_batch}{'+ckpt' if est.options.checkpoint else ''} "
            f"at step {failure[0]}: {failure[1][:120]}"
        )
    return None, refused


@dataclass
class RunPrice:
    """A system's run: its one plan, what it was chosen on, and the run's seconds summed step by step."""

    system: str
    plan: str = ""
    micro_batch: int = 0
    checkpoint: bool = False
    chosen_on: str = ""
    chosen_step_s: float = 0.0  # the plan's step on the mix it was chosen on
    run_s: float | None = None  # None: no plan of the system fits every step
    first_step_s: float = 0.0
    last_step_s: float = 0.0
    refused: list[str] = field(default_factory=list)
    source: str = ""


@dataclass
class DynamicRun:
    """Workload `key` drawn along `shares` (one image share per step) from `data`'s distributions."""

    key: str
    data: DataConfig
    shares: np.ndarray
    gpu: GpuSpec
    eff: Efficiency
    seed: int = 0
    average: Workload | None = None  # set by `price`: the run's mean sequence, for the fixed-mix comparison

    def price(self, systems: dict[str, System] = SYSTEMS) -> dict[str, RunPrice]:
        """Each system deployed once (`deploy`), then every step drawn once and priced under every system."""
        _, gpus, seq_len, batch = PAPER_WORKLOADS[self.key]
        args, work = paper_args(self.key), WorkModel.of(self.key)
        drawer = Drawer(self.data, seq_len, batch, self.seed)
        mixes = [sequence_mix(drawer.draw(s, float(share)), work) for s, share in enumerate(self.shares)]
        bases = [mix_workload(self.key, m, f"{s}", args) for s, m in enumerate(mixes)]
        window = first_window(mixes, batch, self.data.profile_window)
        chosen_on = {"first_window": mean_mix(mixes[:window]), "run_average": mean_mix(mixes)}
        self.average = mix_workload(self.key, chosen_on["run_average"], f"{self.key}@average", args)
        runs, deployed = {}, {}
        for name, system in systems.items():
            runs[name], deployed[name] = self.deploy(
                name, system, mix_workload(self.key, chosen_on[system.chosen_on], "chosen", args), bases
            )
            runs[
                name
            ].chosen_on = f"{system.chosen_on} ({window if system.chosen_on == 'first_window' else len(bases)} steps)"
        steps: dict[str, list[float]] = {name: [] for name in deployed if deployed[name]}
        for s, base in enumerate(bases):
            draw = drawer.draw(s, float(self.shares[s]))
            for name in steps:
                est = deployed[name]
                assert est is not None
                workload = step_workload(base, draw, work, systems[name], est.plan)
                priced = estimate_step(
                    workload, self.gpu, est.plan, est.options, gpus_per_node=min(gpus, 8), eff=self.eff
                )
                steps[name].append(priced.step_time_s)
        for name, seconds in steps.items():
            runs[name].run_s, runs[name].first_step_s, runs[name].last_step_s = sum(seconds), seconds[0], seconds[-1]
        return runs

    def deploy(
        self, name: str, system: System, chosen: Workload, steps: list[Workload]
    ) -> tuple[RunPrice, Estimate | None]:
        """The system's plan: its layout's fastest on the mix it is chosen on that fits every step."""
        gpus = PAPER_WORKLOADS[self.key][1]
        heaviest = max(steps, key=encoder_heaviness)
        ranked = ranked_plans(chosen, self.gpu, gpus, self.eff, system.layout, heaviest)
        best, refused = first_fitting(ranked, steps, self.gpu, self.eff)
        run = RunPrice(name, refused=refused, source=system.source)
        if best is not None:
            run.plan, run.micro_batch, run.checkpoint = (
                best.plan.name,
                best.options.micro_batch,
                best.options.checkpoint,
            )
            run.chosen_step_s = best.step_time_s
        return run, best
