"""Encoder layouts side by side: `omni` (MegaScale-Omni: encoders over every rank, balanced, LSSP for long
items; the phased schedule), `omni_joint` (the same under the joint encoder-LLM schedule: encoders per
micro-batch in the ranks' idle time), `coupled` (Megatron-LLaVA: encoders on the first stage, replicated over
TP) and `disaggregated` (DistTrain: encoders on ranks of their own, pipelined with the LLM per micro-batch, the
joint schedule), on the same data, per image:text mix and plan, with the estimator's predicted speedups over
coupled next to the measured ones (this machine's stored calibration:
`python -m omni_core.measure.calibrate cpu` first, else the catalogue's cpu entry; the report says which).
Full runs add `omni_lssp`: omni with the images over LSSP_TOKENS patches split over 2 ranks.

    python benchmarks/layout_bench.py [--quick] --out layout.json

Model `debug-enc` (debug's LLM with encoders as wide and as deep), packed micro-batches of
SEQ_LEN tokens drawn on the fly (data.source=dynamic) with images of IMAGE_SIDE_PX, the same global batch of
GLOBAL_MICRO micro-batches for every plan, balanced over the data ranks by the default `data.balance` (grouped:
benchmarks/balance_bench.py compares the policies). One launch per (plan, layout) trains every mix in turn, `steps`
warm-up then timed steps each; rounds interleave the launches, and each figure is the median over rounds
(`spread_pct` = (max - min) / median of samples/s). A step lasts as long as its slowest rank. `encoder_s` /
`llm_s` are the median over timed steps of the busiest rank's encoder compute (forward and backward; coupled:
0, its encoders run inside the LLM's stage 0) and of its LLM phase. `bubble_pct` is the idle share of a rank's
span of encoder and LLM work (`runtime.layout_metrics.layout_values`), mean over the LLM's ranks: for pipelined plans
the bubble the joint schedule fills. On CPU `peak_mem_mb` is the peak resident set of
the launch (all its mixes so far).

`--dynamic` runs instead one drifting run per layout (world 2): the mix moves from 1:9 to 9:1 image:text over
the timed steps (`DRIFT`, a `data.synthetic.schedule`), each layout keeps one plan for the whole run (of its
plans at world 2, the one predicted fastest on the data of the first timed step), and the run's measured
seconds (the sum of its timed steps, each its slowest rank's) are compared with the sum of its steps predicted
one by one, each on a profile of DYNAMIC_WINDOW samples of the mix drawn at that step: `dynamic[layout]` =
plan, `measured_run_s`, `predicted_run_s`, `error_pct`, per-step seconds both ways, and each ratio to coupled.
Full runs take the median of DYNAMIC_ROUNDS interleaved rounds. The host is calibrated before the plans are
chosen and after each round; `calibrations` lists them with the runs each predicts, and the figures are the
median calibration's (`dynamic`).

Run it alone (it forks one rank per core at world 2); the report records the load average. On a GPU machine
it runs the same cases with nccl, one GPU per rank.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from omni_core.common.plan import EncoderPlan, ParallelPlan
from omni_core.data.balance import balance_for
from omni_core.data.dataset import open_dataset
from omni_core.data.flops import FlopModel
from omni_core.data.loader import PackedLoader
from omni_core.data.profile import data_ranks, profile_dataset, profile_source
from omni_core.data.profile_result import DatasetProfile
from omni_core.data.sample import KINDS
from omni_core.data.workload import MixSchedule
from omni_core.estimator.calibration import calibration_digest
from omni_core.estimator.recipe_cells import predict_plan, predicted_step_times
from omni_core.measure.calibrate import calibrate_into
from omni_core.recipe.schema import Recipe
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.optimizer import Optimizers
from omni_core.runtime.perf import peak_memory_mb
from omni_core.runtime.plan_rules import resolve_plan, shards_per_node
from omni_core.runtime.ranks import preimport, run_ranks
from omni_core.runtime.replica import build_replica
from omni_core.runtime.step import train_step
from omni_core.runtime.trainer import resolve_dtype

FLAVOR = "debug-enc"
SEQ_LEN = 1024
QUICK_SEQ_LEN = 512
GLOBAL_MICRO = 4  # micro-batches per step over all data shards
IMAGE_SIDE_PX = (64, 160)  # 8..20 patches a side at patch 8: 64..400 patches, one LLM token each
MIXES = {
    "1:9": {"text": 0.9, "image": 0.1},
    "1:1": {"text": 0.5, "image": 0.5},
    "9:1": {"text": 0.1, "image": 0.9},
    "audio": {"text": 0.3, "audio": 0.7},
}
PLANS = {2: ["dp2", "dp1-tp2", "dp1-pp2"], 4: ["dp4", "dp2-tp2", "dp2-pp2"]}
LAYOUTS = ("coupled", "omni", "omni_joint", "disaggregated")
LSSP_LAYOUT = "omni_lssp"  # full runs only: omni with images over LSSP_TOKENS patches split over 2 ranks
LSSP_TOKENS = 256
DRIFT = ({"text": 0.9, "image": 0.1}, {"text": 0.1, "image": 0.9})  # --dynamic: 1:9 to 9:1 over the timed steps
DYNAMIC_STEPS = {True: (1, 6), False: (1, 20)}  # --dynamic (warm-up, timed) steps: quick, full
DYNAMIC_ROUNDS = {True: 1, False: 3}  # --dynamic interleaved rounds (their median run): quick, full
DYNAMIC_WINDOW = 1024  # samples profiled at each step for its prediction: 60-200 packed sequences


def layout_plan(llm: str, layout: str, world: int) -> ParallelPlan:
    """The plan of `layout` for an LLM plan of `world` ranks. Disaggregated keeps the world: the encoders get
    a quarter of it (at least one rank) and the LLM the same degrees on the rest, its data parallelism shrunk."""
    plan = ParallelPlan.parse(llm)
    if layout == "coupled":
        return plan
    if layout in ("omni", "omni_joint"):
        return ParallelPlan.parse(f"{llm}+omni{'-joint' if layout == 'omni_joint' else ''}")
    if layout == LSSP_LAYOUT:
        return ParallelPlan.parse(f"{llm}+omni.v-sp2-t{LSSP_TOKENS}")
    ranks = max(1, world // 4)
    llm_ranks = world - ranks
    others = plan.tp * plan.pp * plan.cp
    dp = max(1, llm_ranks // others)
    if dp * others != llm_ranks:  # e.g. world 2: one LLM rank
        plan = ParallelPlan()
    else:
        plan = ParallelPlan.parse(llm.replace(f"dp{plan.dp}", f"dp{dp}", 1))
    return ParallelPlan(**{**plan.__dict__, "encoders": EncoderPlan("disaggregated", ranks=ranks, schedule="joint")})


def fixed_cases() -> dict[str, dict]:
    """Each mix of MIXES as the `data.synthetic` settings of one case."""
    return {name: {"mix": mix} for name, mix in MIXES.items()}


def bench_recipe(root: Path, case: dict, plan: ParallelPlan) -> Recipe:
    """The bench's recipe for `plan` on `case` (`data.synthetic` settings: a mix, or a mix schedule)."""
    return Recipe.model_validate({
        "experiment": {"name": "layout-bench", "output_dir": str(root / "out"), "seed": 7},
        "data": {"source": "dynamic", "seq_len": SEQ_LEN, "max_image_patches": 400,
                 "synthetic": {"num_samples": 200, **case,
                               "image_side_px": {"min": IMAGE_SIDE_PX[0], "max": IMAGE_SIDE_PX[1]}}},
        "model": {"flavor": FLAVOR},
        "parallel": plan.recipe_fields(),
        "train": {"steps": 1000, "warmup_steps": 1, "grad_accum": GLOBAL_MICRO // plan.dp, "ckpt_every": 0,
                  "dtype": "auto"},
    })


def _rank(rank: int, world: int, root: str, name: str, steps: tuple[int, int], cases: dict[str, dict]) -> dict:
    """Every case under one plan on this rank: per timed step its seconds and metrics."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=device)
    plan = ParallelPlan.parse(name)
    out = {}
    for mix_name, case in cases.items():
        recipe = bench_recipe(Path(root), case, plan)
        if resolve_plan(recipe, world) != plan:
            raise ValueError(f"the bench recipe does not express plan {name}")
        dtype = resolve_dtype(recipe.train.dtype, device)
        replica = build_replica(recipe, plan, info, dtype)
        optimizers = Optimizers(replica.parts, recipe)
        balance = balance_for(recipe, replica.data_rank, plan.dp, shards_per_node(plan, info.world_size))
        batches = iter(PackedLoader(open_dataset(recipe), recipe.data, "train", replica.data_rank, plan.dp,
                                    recipe.experiment.seed, balance)) if replica.loads_data else None
        records = []
        for step in range(sum(steps)):
            start = time.perf_counter()
            micro = [next(batches).to(device) for _ in range(recipe.train.grad_accum)] if batches else []
            loaded = time.perf_counter()
            stats = train_step(replica, optimizers, micro, grad_clip=recipe.train.grad_clip, compute_dtype=dtype)
            if cuda:
                torch.cuda.synchronize(device)
            if step >= steps[0]:
                records.append({"step_s": time.perf_counter() - start, "loader_s": loaded - start,
                                "tokens": stats.tokens, "samples": stats.samples, **stats.metrics})
        if replica.meshes is not None:
            replica.meshes.release()
        out[mix_name] = {"records": records, "peak_mem_mb": peak_memory_mb(device)}
    return out


def launch(root: Path, name: str, steps: tuple[int, int], cases: dict[str, dict] | None = None) -> dict:
    """One launch of `name` (every case, by default every mix): per case the step-level figures over its ranks
    (`step_s_each`: each timed step's slowest rank)."""
    cases = cases or fixed_cases()
    world = ParallelPlan.parse(name).world_size
    ranks = run_ranks(_rank, world, str(root), name, steps, cases, backend="auto")
    result = {}
    for mix in cases:
        per_step = list(zip(*(r[mix]["records"] for r in ranks), strict=True))
        step_s = [max(rec["step_s"] for rec in step) for step in per_step]
        first = [step[0] for step in per_step]  # tokens, samples and the world-reduced metrics agree on all ranks
        result[mix] = {
            "samples_per_s": sum(r["samples"] for r in first) / sum(step_s),
            "tokens_per_s": sum(r["tokens"] for r in first) / sum(step_s),
            "peak_mem_mb": max(r[mix]["peak_mem_mb"] for r in ranks),
            "encoder_s": statistics.median(r["encoder_s_max"] for r in first),
            "llm_s": statistics.median(r["llm_s_max"] for r in first),
            "bubble_pct": statistics.median(r.get("bubble_pct", 0.0) for r in first),
            "step_s": statistics.median(step_s),
            "step_s_each": step_s,
            "loader_s_each": [max(rec["loader_s"] for rec in step) for step in per_step],
            "encoder_s_each": [r["encoder_s_max"] for r in first],
            "llm_s_each": [r["llm_s_max"] for r in first],
        }
    return result


def predicted(root: Path, world: int) -> dict[str, dict[str, dict[str, float | None]]]:
    """The estimator's speedup over coupled per mix, plan and layout (each plan at its own recipe's gradient
    accumulation: the same global batch), from this machine's calibration if one is stored."""
    out: dict = {}
    for mix_name, case in fixed_cases().items():
        profile, _ = profile_dataset(bench_recipe(root, case, ParallelPlan()), root / "profile" / mix_name)
        for llm in PLANS[world]:
            times = {}
            for layout in LAYOUTS:
                plan = layout_plan(llm, layout, world)
                try:
                    times[layout] = predicted_step_times(bench_recipe(root, case, plan), [plan], profile)[plan.name]
                except ValueError as err:
                    print(f"prediction {mix_name} {plan.name}: {err}", file=sys.stderr)
            out.setdefault(mix_name, {})[llm] = {
                layout: times["coupled"] / t if "coupled" in times else None
                for layout, t in times.items() if layout != "coupled"}
    return out


def measure(root: Path, rounds: dict[int, int], layouts: tuple[str, ...], steps: tuple[int, int]
            ) -> tuple[dict, dict]:
    """`rounds[world]` interleaved rounds of every (plan, layout) launch of that world."""
    rounds_seen: dict[tuple[str, str, str], list[dict]] = {}
    errors: dict[tuple[str, str], str] = {}
    for round_index in range(max(rounds.values())):
        for world in (w for w, n in rounds.items() if round_index < n):
            for llm in PLANS[world]:
                for layout in layouts:
                    name = layout_plan(llm, layout, world).name
                    if (llm, layout) in errors:
                        continue
                    started = time.perf_counter()
                    try:
                        result = launch(root, name, steps)
                    except Exception as err:  # noqa: BLE001 - a layout the runtime refuses is reported, not fatal
                        errors[llm, layout] = f"{name}: {str(err).strip().splitlines()[-1]}"
                        print(f"{llm:8} {layout:14} FAILED {errors[llm, layout]}", file=sys.stderr)
                        continue
                    for mix, figures in result.items():
                        rounds_seen.setdefault((mix, llm, layout), []).append({**figures, "plan": name})
                    print(f"{llm:8} {layout:14} {name:32} " + "  ".join(
                        f"{mix} {f['samples_per_s']:6.2f}/s" for mix, f in result.items()) +
                        f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    results: dict = {}
    for (mix, llm, layout), seen in rounds_seen.items():
        rates = [s["samples_per_s"] for s in seen]
        median = {key: statistics.median(s[key] for s in seen) for key in seen[0]
                  if not key.endswith("_each") and key != "plan"}
        median.update(plan=seen[0]["plan"], rounds=len(seen),
                      spread_pct=100 * (max(rates) - min(rates)) / statistics.median(rates))
        results.setdefault(mix, {}).setdefault(llm, {})[layout] = median
    for (llm, layout), error in errors.items():
        for mix in MIXES:
            results.setdefault(mix, {}).setdefault(llm, {})[layout] = {"error": error}
    return results, {f"{llm}/{layout}": e for (llm, layout), e in errors.items()}


def drift_case(steps: tuple[int, int]) -> dict:
    """`--dynamic`'s data: the mix moves from DRIFT[0] to DRIFT[1] over the timed steps (warm-up at the first)."""
    warm, timed = steps
    return {"mix": DRIFT[0], "schedule": [{"step": warm, "mix": DRIFT[0]}, {"step": warm + timed - 1, "mix": DRIFT[1]}]}


def step_profile(recipe: Recipe, step: int) -> DatasetProfile:
    """The data drawn at optimizer step `step`: DYNAMIC_WINDOW samples of the schedule's mix there, held. A
    window read along the schedule from `step` on would drift past it, and one as short as a step's data packs
    a few sequences whose last is partly filled: 16 samples packed 2-4 sequences 0.63-0.81 full where the
    loader's are 0.99, and priced a step's encoders up to a third short."""
    shares = MixSchedule(recipe.data.synthetic).at(step)
    synthetic = recipe.data.synthetic.model_copy(
        update={"mix": {kind: float(share) for kind, share in zip(KINDS, shares) if share > 0}, "schedule": [],
                "num_samples": DYNAMIC_WINDOW})
    held = recipe.model_copy(update={"data": recipe.data.model_copy(update={"synthetic": synthetic})})
    return profile_source(open_dataset(held), held.data, held.experiment.seed, FlopModel.for_recipe(held),
                          DYNAMIC_WINDOW, by_record=True, balance_ranks=data_ranks(held),
                          step_batches=held.train.grad_accum)


def dynamic_plans(root: Path, steps: tuple[int, int], world: int) -> dict[str, ParallelPlan]:
    """Each layout's one plan for the run: of its plans at `world`, the fastest predicted on the data of the
    first timed step (the window a job is planned on)."""
    chosen = {}
    for layout in LAYOUTS:
        plans = {p.name: p for p in (layout_plan(llm, layout, world) for llm in PLANS[world])}
        priced = {}
        for name, plan in plans.items():
            recipe = bench_recipe(root, drift_case(steps), plan)
            try:
                priced[name] = predicted_step_times(recipe, [plan], step_profile(recipe, steps[0]))[name]
            except ValueError as err:
                print(f"prediction {name}: {err}", file=sys.stderr)
        chosen[layout] = plans[min(priced, key=lambda n: priced[n])]
    return chosen


def dynamic(root: Path, steps: tuple[int, int], rounds: int, world: int = 2,
            calibrate: Callable[[], dict] | None = None) -> tuple[dict, list[dict]]:
    """`--dynamic`: each layout's one plan over the drifting run, measured (the sum of its timed steps, each
    its slowest rank's; median over rounds) against the sum of its steps predicted one by one, each on the
    data drawn at that step, plus the host data path each step measured (the slowest rank's loader seconds:
    the ranks draw and render their samples inside the step, which the estimator does not price; the
    validation adds it the same way, `case_prediction.loader_seconds`). `estimator_error_pct` leaves it out.

    `calibrate` (a fresh calibration that points this process's estimates at itself) runs before the plans
    are chosen and again after each round: this host's speed halves for tens of seconds at a time, and one
    calibration made in a slow moment priced a run 46% slow (as a run measured in one is slow: the rounds).
    Every step is priced under each of them, and the run's figures come from the median one
    (`median_calibration`: the calibration whose predicted runs of all layouts sum to the median; one whole
    calibration, its terms fitted together). Returns the figures per layout and each calibration with its
    predicted run seconds per layout."""
    calibrations = [calibrate()] if calibrate else []
    plans = dynamic_plans(root, steps, world)
    measured: dict[str, list[dict]] = {layout: [] for layout in plans}
    for _ in range(rounds):
        for layout, plan in plans.items():
            started = time.perf_counter()
            measured[layout].append(launch(root, plan.name, steps, {"drift": drift_case(steps)})["drift"])
            print(f"dynamic {layout:14} {plan.name:24} measured {sum(measured[layout][-1]['step_s_each']):6.2f} s "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
        if calibrate:
            calibrations.append(calibrate())
    estimates = priced_steps(root, steps, plans, [c["folder"] for c in calibrations] or [None])
    chosen = median_calibration(estimates)
    for calibration, by_layout in zip(calibrations, estimates):
        calibration["predicted_run_s"] = {layout: sum(e.step_time_s for e in by_layout[layout]) for layout in plans}
        calibration["median_calibration"] = calibration is calibrations[chosen]
    out = {layout: run_figures(plan, measured[layout], estimates[chosen][layout]) for layout, plan in plans.items()}
    base = out["coupled"]
    for figures in out.values():
        figures["measured_vs_coupled"] = base["measured_run_s"] / figures["measured_run_s"]
        figures["predicted_vs_coupled"] = base["predicted_run_s"] / figures["predicted_run_s"]
        figures["estimator_vs_coupled"] = base["estimator_run_s"] / figures["estimator_run_s"]
    return out, calibrations


def median_calibration(estimates: list[dict[str, list]]) -> int:
    """Which calibration's predictions a run reports: the one whose predicted runs of every layout sum to the
    median (of two middle ones, the faster)."""
    totals = [sum(e.step_time_s for by_step in by_layout.values() for e in by_step) for by_layout in estimates]
    return totals.index(statistics.median_low(totals))


def priced_steps(root: Path, steps: tuple[int, int], plans: dict[str, ParallelPlan],
                 folders: list[str | None]) -> list[dict[str, list]]:
    """Per calibration folder (None: the estimates' current one), each layout's timed steps predicted one by
    one, each on the data drawn at that step (profiled once, priced under every calibration)."""
    profiles = {layout: (bench_recipe(root, drift_case(steps), plan), plan) for layout, plan in plans.items()}
    data = {layout: [step_profile(recipe, s) for s in range(steps[0], sum(steps))]
            for layout, (recipe, _) in profiles.items()}
    priced = []
    for folder in folders:
        if folder is not None:
            os.environ["OMNI_CALIBRATION_DIR"] = folder
        priced.append({layout: [predict_plan(recipe, plan, profile) for profile in data[layout]]
                       for layout, (recipe, plan) in profiles.items()})
    return priced


def run_figures(plan: ParallelPlan, measured: list[dict], estimates: list) -> dict:
    """A layout's run, measured (median over rounds) and predicted step by step (`estimates`), the loader's
    measured seconds added to the prediction."""
    predicted = [e.step_time_s for e in estimates]
    runs = [sum(r["step_s_each"]) for r in measured]
    steps_s = [statistics.median(s) for s in zip(*(r["step_s_each"] for r in measured))]
    loader = [statistics.median(s) for s in zip(*(r["loader_s_each"] for r in measured))]
    run_s, estimator_s = statistics.median(runs), sum(predicted)
    pred_s = estimator_s + sum(loader)
    return {"plan": plan.name, "measured_run_s": run_s, "predicted_run_s": pred_s,
            "error_pct": 100 * (pred_s / run_s - 1), "estimator_run_s": estimator_s,
            "estimator_error_pct": 100 * (estimator_s / run_s - 1), "loader_run_s": sum(loader),
            "spread_pct": 100 * (max(runs) - min(runs)) / run_s,
            "measured_step_s": steps_s,
            "predicted_step_s": [p + d for p, d in zip(predicted, loader)],
            "loader_step_s": loader,
            # where the time goes, summed over the run: measured, the busiest rank's encoder compute and LLM
            # phase (the step's world-reduced metrics); predicted, the omni encoders' exposed seconds (coupled:
            # inside the pipeline) and the pipeline's
            "measured_parts_s": {part: statistics.median(sum(r[f"{part}_each"]) for r in measured)
                                 for part in ("encoder_s", "llm_s")},
            "predicted_parts_s": {"encoder_s": sum(e.breakdown.get("encoder_s", 0.0) for e in estimates),
                                  "pipeline_s": sum(e.breakdown["pipeline_s"] for e in estimates)}}


def speedups(results: dict, layout: str) -> dict:
    out: dict = {}
    for mix, plans in results.items():
        for llm, layouts in plans.items():
            base, other = layouts.get("coupled", {}), layouts.get(layout, {})
            ok = "samples_per_s" in base and "samples_per_s" in other
            out.setdefault(mix, {})[llm] = other["samples_per_s"] / base["samples_per_s"] if ok else None
    return out


def main_dynamic(quick: bool, out: str, fresh: bool) -> None:
    """`--dynamic`: the drifting run alone, each layout one plan (world 2), predicted from calibrations made
    between its runs (`fresh`, see `dynamic`) or the stored one."""
    steps = DYNAMIC_STEPS[quick]
    started = time.perf_counter()
    report: dict = {"load_average": {"start": os.getloadavg()},
                    "workload": {"flavor": FLAVOR, "seq_len": SEQ_LEN, "global_micro_batches": GLOBAL_MICRO,
                                 "image_side_px": IMAGE_SIDE_PX, "drift": DRIFT, "window": DYNAMIC_WINDOW,
                                 "warmup_steps": steps[0], "timed_steps": steps[1],
                                 "rounds": DYNAMIC_ROUNDS[quick], "world": 2,
                                 "device": "cuda" if torch.cuda.is_available() else "cpu"}}
    with tempfile.TemporaryDirectory() as tmp:  # predictions from this host as it is now
        folders = itertools.count()
        calibrate = (lambda: calibrate_into(Path(tmp) / "calibration" / str(next(folders)), world=2)) if fresh else None
        preimport()
        report["dynamic"], calibrations = dynamic(Path(tmp), steps, DYNAMIC_ROUNDS[quick], calibrate=calibrate)
    report["calibrations"] = calibrations or calibration_digest("cpu")
    report["load_average"]["end"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - started
    Path(out).write_text(json.dumps(report, indent=2))
    for calibration in calibrations:
        print(f"calibration {calibration['fp32_flops'] / 1e9:5.0f} GFLOP/s  predicted runs " + "  ".join(
            f"{layout} {s:6.2f} s" for layout, s in calibration["predicted_run_s"].items())
            + ("  (median)" if calibration["median_calibration"] else ""))
    for layout, f in report["dynamic"].items():
        print(f"{layout:14} {f['plan']:24} run measured {f['measured_run_s']:6.2f} s "
              f"predicted {f['predicted_run_s']:6.2f} s ({f['error_pct']:+.1f}%; estimator alone "
              f"{f['estimator_error_pct']:+.1f}%)  "
              f"vs coupled measured {f['measured_vs_coupled']:.2f} predicted {f['predicted_vs_coupled']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="world 2, one round, fewer steps, QUICK_SEQ_LEN-token "
                        "micro-batches, half as many per step (< 2 min on CPU)")
    parser.add_argument("--out", default="layout.json")
    parser.add_argument("--dynamic", action="store_true", help="only the drifting run: each layout one plan, "
                        "its steps predicted one by one against the measured run (world 2)")
    parser.add_argument("--calibration", choices=("fresh", "stored"), default="fresh",
                        help="--dynamic: calibrate this host first (default), or predict from the stored calibration")
    args = parser.parse_args()
    # the targets are at world 2 (one rank per core): its rounds are the medians; world 4 is one round
    rounds, steps = ({2: 1}, (1, 1)) if args.quick else ({2: 3, 4: 1}, (1, 3))
    if args.quick:  # half the tokens per micro-batch, half the micro-batches: every case within two minutes
        global SEQ_LEN, GLOBAL_MICRO
        SEQ_LEN, GLOBAL_MICRO = QUICK_SEQ_LEN, GLOBAL_MICRO // 2
    if args.dynamic:
        main_dynamic(args.quick, args.out, args.calibration == "fresh")
        return
    layouts = LAYOUTS if args.quick else (*LAYOUTS, LSSP_LAYOUT)
    started = time.perf_counter()
    report: dict = {"load_average": {"start": os.getloadavg()},
                    "workload": {"flavor": FLAVOR, "seq_len": SEQ_LEN, "global_micro_batches": GLOBAL_MICRO,
                                 "image_side_px": IMAGE_SIDE_PX, "mixes": MIXES, "lssp_tokens": LSSP_TOKENS,
                                 "layouts": layouts, "calibration": calibration_digest("cpu") or "catalogue",
                                 "warmup_steps": steps[0], "timed_steps": steps[1],
                                 "rounds_by_world": rounds, "device": "cuda" if torch.cuda.is_available() else "cpu"}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        preimport()
        predictions: dict = {}
        for world in rounds:
            for mix, plans in predicted(root, world).items():
                predictions.setdefault(mix, {}).update(plans)
        report["results"], report["errors"] = measure(root, rounds, layouts, steps)
    report["speedup_vs_coupled"] = speedups(report["results"], "omni")
    report["joint_vs_coupled"] = speedups(report["results"], "omni_joint")
    report["disaggregated_vs_coupled"] = speedups(report["results"], "disaggregated")
    report["predicted_speedup_vs_coupled"] = {mix: {llm: p.get("omni") for llm, p in plans.items()}
                                              for mix, plans in predictions.items()}
    report["predicted_joint_vs_coupled"] = {mix: {llm: p.get("omni_joint") for llm, p in plans.items()}
                                            for mix, plans in predictions.items()}
    report["predicted_disaggregated_vs_coupled"] = {mix: {llm: p.get("disaggregated") for llm, p in plans.items()}
                                                    for mix, plans in predictions.items()}
    report["prediction_error_pct"] = {
        mix: {llm: (100 * (pred / report["speedup_vs_coupled"][mix][llm] - 1)
                    if pred and report["speedup_vs_coupled"][mix].get(llm) else None)
              for llm, pred in plans.items()}
        for mix, plans in report["predicted_speedup_vs_coupled"].items()}
    report["load_average"]["end"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2))
    nan = float("nan")
    for mix, plans in report["speedup_vs_coupled"].items():
        for llm, ratio in plans.items():
            pred = report["predicted_speedup_vs_coupled"][mix].get(llm)
            disagg = report["disaggregated_vs_coupled"][mix].get(llm)
            joint, joint_pred = report["joint_vs_coupled"][mix].get(llm), report["predicted_joint_vs_coupled"][mix].get(llm)
            print(f"{mix:6} {llm:8} omni/coupled measured {ratio or nan:.2f} predicted {pred or nan:.2f}   "
                  f"joint/coupled measured {joint or nan:.2f} predicted {joint_pred or nan:.2f}   "
                  f"disaggregated/coupled measured {disagg or nan:.2f} "
                  f"predicted {report['predicted_disaggregated_vs_coupled'][mix].get(llm) or nan:.2f}")


if __name__ == "__main__":
    main()
