"""MLflow logging overhead as a share of training step time, side by side in one process.

Trains the same tiny recipe twice on one rank with metrics logged at every step (the worst case):
once through the MLflow tracker into a fresh sqlite store, once through the null tracker. Alternating
short rounds of each keeps machine noise from landing on one side only.

    python benchmarks/tracking_overhead.py [--quick] --out report.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from omni_core.recipe.schema import Recipe
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.trainer import train
from omni_core.tracking import MlflowTracker, NullTracker, Tracker, disable_telemetry


def recipe(root: Path, name: str, steps: int) -> Recipe:
    return Recipe.model_validate({
        "experiment": {"name": name, "output_dir": str(root / "out")},
        "data": {"path": str(root / "data"), "synthetic": {"num_samples": 400}},
        "train": {"steps": steps, "log_every": 1, "ckpt_every": 0, "resume": False},
    })


def timed_steps(r: Recipe, tracker: Tracker) -> tuple[float, float]:
    """Seconds per step and the share of it spent inside tracker calls on the training thread."""
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    result = train(r, info, tracker=tracker, log=lambda _: None)
    return result.wall_s / result.steps, result.logging_overhead_pct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds (well under 2 minutes)")
    parser.add_argument("--out", default="tracking_overhead.json")
    args = parser.parse_args()
    rounds, steps = (3, 20) if args.quick else (6, 40)
    disable_telemetry()
    torch.set_num_threads(1)

    from mlflow import MlflowClient

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        uri = f"sqlite:///{root / 'mlflow.db'}"
        client = MlflowClient(uri)
        experiment = client.create_experiment("overhead", artifact_location=str(root / "artifacts"))
        timings: dict[str, list[float]] = {"mlflow": [], "null": []}
        caller_share: list[float] = []
        for i in range(rounds):
            run_id = client.create_run(experiment).info.run_id
            tracker = MlflowTracker(run_id, uri, flush_every_s=2.0)
            seconds, share = timed_steps(recipe(root, f"mlflow{i}", steps), tracker)
            tracker.close()
            timings["mlflow"].append(seconds)
            caller_share.append(share)
            timings["null"].append(timed_steps(recipe(root, f"null{i}", steps), NullTracker())[0])
            logged = len(client.get_metric_history(run_id, "train/loss"))
            assert logged == steps, f"expected {steps} logged losses, found {logged}"

    with_mlflow, without = statistics.median(timings["mlflow"]), statistics.median(timings["null"])
    report = {
        "step_s_mlflow": with_mlflow,
        "step_s_null": without,
        "overhead_pct_of_step": 100.0 * (with_mlflow - without) / without,
        "caller_thread_pct_of_step": statistics.median(caller_share),
        "metrics_per_step": "all train/* and perf/* keys, every step",
        "rounds": rounds,
        "steps_per_round": steps,
        "wall_s": time.perf_counter() - started,
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
