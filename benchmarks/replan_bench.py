"""Re-planning a drifting job: the same workload and steps three ways, side by side in one invocation.

    python benchmarks/replan_bench.py [--quick] --out replan.json

The workload is recipes/drifting_mix.yaml (long text documents, then from step 40 rare large images, loaded
without balancing: its header says why the best plan moves, measured and predicted) on this machine's 2
ranks, each way a whole train stage (`flows.train.train_flow`: torchrun, checkpoints, MLflow):
- `initial`: the best static plan for the data at the start (`replan.best_overrides` on the first window);
- `oracle`: the best static plan for the whole run's data (a profile of as many samples as the run reads);
- `replanned`: starts as `initial`, and the watcher re-plans it when the drift pays (`replan.enabled`), its
  re-plan cost measured on the running launch.
Every prediction (the watcher's and the report's) is from a calibration made right before the rounds
(`--calibration fresh`). Rounds interleave the three ways, each round starting one way later (in three rounds
each way runs first, second and third once: a host that slows over a round favours none); figures are medians
over rounds with their spread. `total_s` is the wall time of the stage (restarts included), `tokens_per_s`
the tokens trained over it, `replan_cost_s` what the way spent outside steps beyond `initial` (the re-plans'
restarts and saves), `prediction_error_pct` the estimator's step time against the measured one as the train
stage logs it per launch (median; a launch without a watcher is priced on the profile the stage was given,
none here), `step_by_step` the same priced on the data each launch read (`predicted_vs_measured`), and
`oracle_gain_per_step` the initial plan's step over the oracle's, predicted and measured: whether the gap the
workload was designed on is there. `switch` (per round) is the look that re-planned: its step, the
checkpoint the job stopped at, both plans, the predicted gain per step (1 - best / running, both on the look's
window) and in seconds, the cost it was weighed against, and the gain measured after the switch: the
re-planned run's steps after its first one under the new plan against the same steps of `initial`
(`perf/step_s`, logged every step). Run it alone; the report records the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from omni_core.data.dataset import open_dataset  # noqa: E402
from omni_core.data.flops import FlopModel  # noqa: E402
from omni_core.data.profile import data_ranks, profile_source  # noqa: E402
from omni_core.measure.calibrate import calibrate_into  # noqa: E402
from omni_core.recipe.loader import load_recipe, override_recipe  # noqa: E402
from omni_core.recipe.schema import Recipe  # noqa: E402
from omni_core.scheduler.replan import (  # noqa: E402
    best_overrides,
    plan_of,
    predicted_step_s,
    window_profile,
)

RECIPE = ROOT / "recipes" / "drifting_mix.yaml"
WAYS = ("initial", "oracle", "replanned")
GPU = "cpu"


def workload(root: Path, quick: bool) -> list[str]:
    """The bench's overrides of the recipe: its own folders and MLflow store; `--quick` a shorter run whose
    mix moves as early in it."""
    base = [f"tracking.uri=sqlite:///{root}/mlflow.db", "parallel.plan=explicit", "train.timeout_s=1200"]
    if quick:
        base += ["train.steps=14", "train.ckpt_every=4", "replan.every_steps=2", "replan.window=16",
                 "data.synthetic.schedule=[{step: 0, mix: {text: 1.0}}, {step: 5, mix: {text: 1.0}},"
                 " {step: 6, mix: {text: 0.9, image: 0.1}}]"]
    return base


def whole_run_profile(recipe: Recipe):
    """The data of the whole run: the samples one rank reads over train.steps steps (documents per sequence
    taken as the mean of the first and last windows'), profiled in stream order along the schedule."""
    first = window_profile(recipe, 0, 0)
    last = window_profile(recipe, recipe.train.steps, 0)
    per_sequence = (first.sequences.documents_mean + last.sequences.documents_mean) / 2
    samples = round(recipe.train.steps * recipe.train.grad_accum * recipe.data.micro_batch * per_sequence)
    cfg = recipe.data
    flops = FlopModel.for_flavor(recipe.model.flavor, patch_size=cfg.patch_size, n_mels=cfg.n_mels)
    return profile_source(open_dataset(recipe), cfg, recipe.experiment.seed, flops, samples, by_record=True,
                          balance_ranks=data_ranks(recipe), step_batches=recipe.train.grad_accum)


def launches(way: dict, overrides: list[str], steps: int) -> list[tuple[int, int, list[str]]]:
    """(first step, last step, overrides) of each launch of a way: one, or two around a re-plan."""
    decision = next((d for d in way["looks"] if d["replan"]), None)
    if decision is None:
        return [(0, steps, overrides)]
    return [(0, decision["stop_step"], overrides), (decision["stop_step"], steps, [*overrides, *decision["overrides"]])]


def predicted_vs_measured(recipe: Recipe, runs: list[tuple[int, int, list[str]]], step_s: dict[int, float]) -> dict:
    """Seconds per step predicted step by step (each launch's plan priced on the window every
    `replan.every_steps` steps it trained, held until the next: how the watcher prices a launch) beside the
    measured mean over the same steps, each launch's first step left out on both sides (it pays the launch)."""
    every, predicted, counted = recipe.replan.every_steps or recipe.train.ckpt_every, 0.0, 0
    for first, last, overrides in runs:
        launch = override_recipe(recipe, overrides)
        for start in range(first + 1, last, every):
            held = min(every, last - start)
            predicted += held * predicted_step_s(launch, window_profile(launch, start - 1, 0), GPU)
            counted += held
    firsts = {first + 1 for first, _, _ in runs}
    measured = [v for k, v in step_s.items() if k not in firsts]
    mean = statistics.mean(measured) if measured else float("nan")
    return {"predicted_step_s": predicted / counted, "measured_step_s": mean,
            "error_pct": 100 * (predicted / counted / mean - 1)}


def run_way(root: Path, overrides: list[str], name: str) -> dict:
    from mlflow import MlflowClient

    from flows.train import train_flow

    out = root / name
    tic = time.perf_counter()
    result = train_flow(str(RECIPE), [*overrides, f"experiment.output_dir={out}", f"experiment.name={name}"])
    total = time.perf_counter() - tic
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    experiment = client.get_experiment_by_name(name).experiment_id
    [run] = client.search_runs([experiment], "attributes.run_name = 'train'")
    errors = [m.value for m in client.get_metric_history(run.info.run_id, "estimate/error_pct")]
    step_s = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "perf/step_s")}
    tokens = result.tokens_per_s * result.wall_s
    return {"total_s": total, "tokens_per_s": tokens / total, "step_s_total": result.wall_s,
            "outside_steps_s": total - result.wall_s, "replans": run.data.metrics.get("replan/replans", 0.0),
            "prediction_error_pct": statistics.median(errors) if errors else float("nan"),
            "final_plan": result.plan, "final_loss": result.final_loss,
            "step_s": step_s, "looks": looks(client, experiment, out)}


def looks(client, experiment: str, folder: Path) -> list[dict]:
    """The way's looks (its `replan-<step>` runs), in step order: each decision as the watcher logged it."""
    runs = client.search_runs([experiment], "attributes.run_name LIKE 'replan-%'")
    decisions = [json.loads(Path(client.download_artifacts(r.info.run_id, "decision.json", str(folder))).read_text())
                 for r in runs]
    return sorted(decisions, key=lambda d: d["step"])


def switch(replanned: dict, initial: dict) -> dict | None:
    """The look that re-planned a run (None: none did) with its predicted gain, beside the gain measured after
    the switch: the new launch's steps after its first (which pays the restart) against the same steps of
    the initial plan's run."""
    decision = next((d for d in replanned["looks"] if d["replan"]), None)
    if decision is None:
        return None
    after = [s for s in replanned["step_s"] if s > decision["stop_step"] + 1 and s in initial["step_s"]]
    mean_replanned = statistics.mean(replanned["step_s"][s] for s in after) if after else float("nan")
    mean_initial = statistics.mean(initial["step_s"][s] for s in after) if after else float("nan")
    predicted = 1 - decision["predicted_best_s"] / decision["predicted_running_s"]
    measured = 1 - mean_replanned / mean_initial
    return {"look_step": decision["step"], "stop_step": decision["stop_step"], "from": decision["running_plan"],
            "to": decision["best_plan"], "reason": decision["reason"], "cost_s": decision["cost_s"],
            "predicted_gain_s": decision["gain_s"], "predicted_gain_pct": 100 * predicted,
            "measured_gain_pct": 100 * measured, "measured_gain_s": len(after) * (mean_initial - mean_replanned),
            "steps_compared": len(after), "gain_error_pct": 100 * (predicted / measured - 1) if measured else None}


def warm_up() -> None:
    """Start Prefect's temporary server before the first timed way, which would pay for it otherwise."""
    from prefect import flow

    import flows  # noqa: F401 - Prefect's settings and telemetry off, before Prefect is imported

    flow(name="warm-up")(lambda: None)()


def summary(runs: list[dict], initial: list[dict]) -> dict:
    total = [r["total_s"] for r in runs]
    return {
        "total_s": statistics.median(total),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "replans": statistics.median(r["replans"] for r in runs),
        "replan_cost_s": statistics.median(r["outside_steps_s"] - i["outside_steps_s"] for r, i in zip(runs, initial)),
        "prediction_error_pct": statistics.median(r["prediction_error_pct"] for r in runs),
        "step_by_step": {k: statistics.median(r["step_by_step"][k] for r in runs) for k in runs[0]["step_by_step"]},
        "spread_pct": 100 * (max(total) - min(total)) / statistics.median(total),
        "final_plan": runs[-1]["final_plan"], "final_loss": statistics.median(r["final_loss"] for r in runs),
        "looks": [[(d["step"], d["replan"], d["reason"]) for d in r["looks"]] for r in runs],
        "rounds": [{k: v for k, v in r.items() if k != "looks"} for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 14-step run, one round (<= 2 minutes)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 1 quick, 3 full)")
    parser.add_argument("--out", required=True, help="JSON report")
    parser.add_argument("--workdir", default=None, help="folder for the runs (default: a fresh one under /tmp)")
    parser.add_argument("--calibration", choices=("fresh", "stored"), default="fresh",
                        help="calibrate this host first (default), or predict from the stored calibration")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="replan-bench-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    base = workload(root, args.quick)
    recipe = load_recipe(RECIPE, base)
    # --quick calibrates the kernels only (the links keep the catalogue's), to stay within two minutes
    world = 1 if args.quick else recipe.parallel.nproc
    calibration = calibrate_into(root / "calibration", world) if args.calibration == "fresh" else {
        "folder": os.environ.get("OMNI_CALIBRATION_DIR", "the default")}
    initial = best_overrides(recipe, window_profile(recipe, 0, 0), GPU)
    oracle = best_overrides(recipe, whole_run_profile(recipe), GPU)
    ways = {"initial": [*base, *initial, "replan.enabled=false"],
            "oracle": [*base, *oracle, "replan.enabled=false"],
            "replanned": [*base, *initial, "replan.enabled=true"]}
    report: dict = {"load_average": {"start": os.getloadavg()}, "quick": args.quick, "rounds": rounds,
                    "steps": recipe.train.steps, "workdir": str(root), "calibration": calibration,
                    "plans": {way: plan_of(override_recipe(recipe, o)).name for way, o in ways.items()}}
    print(f"plans: {report['plans']}", flush=True)
    warm_up()
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for k in range(rounds):
        for way in WAYS[k % len(WAYS) :] + WAYS[: k % len(WAYS)]:
            runs[way].append(run_way(root, ways[way], f"{way}-{k}"))
            r = runs[way][-1]
            r["step_by_step"] = predicted_vs_measured(
                recipe, launches(r, ways[way], recipe.train.steps), r["step_s"]
            )
            print(f"round {k} {way:<10} {r['total_s']:7.1f} s  {r['tokens_per_s']:7.0f} tokens/s  "
                  f"replans {r['replans']:.0f}  prediction error {r['prediction_error_pct']:+.1f}%  "
                  f"step by step {r['step_by_step']['predicted_step_s']:.3f} s predicted, "
                  f"{r['step_by_step']['measured_step_s']:.3f} s measured", flush=True)
    report.update({way: summary(runs[way], runs["initial"]) for way in WAYS})
    report["speedup_vs_initial"] = {way: statistics.median(i["total_s"] / r["total_s"]
                                                           for i, r in zip(runs["initial"], runs[way])) for way in WAYS}
    report["replanned_vs_oracle"] = statistics.median(o["total_s"] / r["total_s"]
                                                      for o, r in zip(runs["oracle"], runs["replanned"]))
    # is the gap the workload was designed on there when measured? initial / oracle per step, both ways
    report["oracle_gain_per_step"] = {
        side: statistics.median(i["step_by_step"][f"{side}_step_s"] / o["step_by_step"][f"{side}_step_s"]
                                for i, o in zip(runs["initial"], runs["oracle"])) for side in ("predicted", "measured")}
    report["switch"] = [switch(r, i) for r, i in zip(runs["replanned"], runs["initial"])]
    report["load_average"]["end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(report, indent=2))
    keys = ("plans", "speedup_vs_initial", "replanned_vs_oracle", "oracle_gain_per_step", "switch")
    print(json.dumps({k: report[k] for k in keys}, indent=2))


if __name__ == "__main__":
    main()
