"""torchrun entry point: `torchrun --nproc-per-node N -m omni_core.runtime.launch --recipe R.yaml`.

The same command runs on CPU (gloo) and GPU (nccl). Rank 0 prints progress and logs to the MLflow run
named by $MLFLOW_RUN_ID; other ranks log through a null tracker. The result JSON is written by rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from omni_core.recipe.loader import load_recipe
from omni_core.runtime.dist import init_distributed, shutdown
from omni_core.runtime.trainer import train
from omni_core.tracking import SPOOL_FILE, system_metrics, tracker_for_rank


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="omni_core.runtime.launch", description=__doc__)
    parser.add_argument("--recipe", required=True, help="recipe YAML (usually the resolved one a flow wrote)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--result", help="where rank 0 writes the TrainResult JSON")
    return parser.parse_args(argv)


@record  # an exception out of main lands in torch elastic's error file, for the supervisor to name
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    info = init_distributed(recipe.parallel.backend, recipe.train.dist_timeout_s)
    # metrics the tracking server missed are kept beside the result, for the train stage to replay
    spool = Path(args.result).with_name(SPOOL_FILE) if args.result else None
    tracker = tracker_for_rank(
        info.rank,
        flush_every_s=recipe.tracking.flush_every_s,
        spool=spool,
        reconnect_timeout_s=recipe.tracking.reconnect_timeout_s,
    )

    def log(message: str) -> None:
        if info.is_main:
            print(message, flush=True)

    exit_code = 0
    # MLflow's system metrics: one monitor per node (torchrun's GROUP_RANK), in its first local rank
    node = int(os.environ.get("GROUP_RANK", "0"))
    monitoring = system_metrics(node) if info.local_rank == 0 else contextlib.nullcontext()
    try:
        with monitoring:
            result = train(recipe, info, tracker=tracker, log=log)
        if info.is_main:
            log(
                f"done: loss {result.initial_loss:.4f} -> {result.final_loss:.4f}, "
                f"{result.tokens_per_s:.0f} tokens/s, checkpoint {result.checkpoint}"
            )
            if args.result:
                result.save(Path(args.result))
    except Exception as error:
        print(f"[rank {info.rank}] training failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        ErrorHandler().record_exception(error)  # TORCHELASTIC_ERROR_FILE: the launch's error names this one
        exit_code = 1
    finally:
        tracker.close()  # lost metrics are warned about there, never a failed training
    shutdown(exit_code)


if __name__ == "__main__":
    main()
