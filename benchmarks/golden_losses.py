"""Golden losses: every step's training loss of the quickstart recipe (dp2, 2 ranks) and of the debug model
under dp2, dp1-tp2 and dp1-pp2 (all in the quickstart's encoder layout, omni), to hold a refactor to
bit-for-bit equal numerics on CPU.

    python benchmarks/golden_losses.py [--quick] --out golden.json [--compare before.json]

The losses are stored as `repr` of the float (exact); `--compare` exits 1 naming the first step that differs.
`--quick` trains the quickstart for 30 steps instead of its 300 (the plans train 30 steps either way).
No checkpoint is written. Run it alone: the numbers do not depend on load, the minutes it takes do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from omni_core.recipe import load_recipe
from omni_core.runtime.dist import DistInfo
from omni_core.runtime.ranks import run_ranks
from omni_core.runtime.trainer import train
from omni_core.tracking import NullTracker

ROOT = Path(__file__).resolve().parents[1]
PLAN_STEPS = ["train.steps=30"]
CASES = {
    "dp2": PLAN_STEPS,
    "dp1-tp2": [*PLAN_STEPS, "parallel.tp=2"],
    "dp1-pp2": [*PLAN_STEPS, "parallel.pp=2", "train.grad_accum=2"],
}


class LossRecorder(NullTracker):
    def __init__(self) -> None:
        super().__init__()
        self.losses: dict[int, float] = {}

    def log_metrics(self, metrics, step: int) -> None:
        if "train/loss" in metrics:
            self.losses[step] = metrics["train/loss"]


def _train_cases(rank: int, world: int, root: str, cases: dict[str, list[str]]) -> dict[str, dict[int, float]]:
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    losses = {}
    for name, overrides in cases.items():
        recipe = load_recipe(ROOT / "recipes/quickstart.yaml",
                             [f"experiment.output_dir={root}", "train.log_every=1", *overrides])
        recorder = LossRecorder()
        train(recipe, info, tracker=recorder, log=lambda message: None, save=False)
        losses[name] = recorder.losses
    return losses


def first_difference(ours: dict, theirs: dict) -> str | None:
    for case in sorted(set(ours) | set(theirs)):
        a, b = ours.get(case, {}), theirs.get(case, {})
        for step in sorted(set(a) | set(b), key=int):
            if a.get(step) != b.get(step):
                return f"{case} step {step}: {a.get(step)} vs {b.get(step)}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", metavar="JSON", help="a report of an earlier run to hold these losses to")
    args = parser.parse_args()
    cases = {"quickstart": ["train.steps=30"] if args.quick else [], **CASES}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        losses = run_ranks(_train_cases, 2, root, cases)[0]
    report = {"quick": args.quick, "seconds": time.perf_counter() - started, "loadavg": os.getloadavg(),
              "losses": {case: {str(step): repr(loss) for step, loss in steps.items()}
                         for case, steps in losses.items()}}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print({case: f"{len(steps)} steps, last {list(steps.values())[-1]!r}" for case, steps in report["losses"].items()})
    if args.compare:
        difference = first_difference(report["losses"], json.loads(Path(args.compare).read_text())["losses"])
        print(f"differs from {args.compare}: {difference}" if difference else f"identical to {args.compare}")
        return 1 if difference else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
