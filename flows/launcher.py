"""The torchrun task: training launched as `torchrun ... -m omni_core.runtime.launch` under the process-group
supervisor (omni_core.runtime.supervisor), or as a Slurm batch job (omni_core.runtime.slurm), rank 0's output
streamed into the task's log. Its retries (the train stage sets how many) are only for launches the
infrastructure broke."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from omni_core.common.results import TrainResult
from omni_core.recipe.train_sections import LaunchConfig
from omni_core.runtime.slurm import run_slurm_job
from omni_core.runtime.supervisor import LaunchError, launch_torchrun
from omni_core.runtime.targets import RunSpec, run_name


def infrastructure_failure(_task: object, _task_run: object, state: State) -> bool:
    """The torchrun task's retry condition: a rank killed from outside (`LaunchError.infrastructure`), never
    the code's own error or the wall-clock limit, which a retry would only repeat."""
    return isinstance(state.data, LaunchError) and state.data.infrastructure


@task(name="torchrun", cache_policy=NO_CACHE, retry_condition_fn=infrastructure_failure, retry_delay_seconds=5)
def run_torchrun(
    recipe_path: str,
    nproc: int,
    result_path: str,
    env_extra: Mapping[str, str],
    timeout_s: float,
    max_restarts: int = 0,
    launch: LaunchConfig | None = None,
    name: str = "omni",
) -> TrainResult:
    """Train under torchrun, here or as a Slurm job (`launch.target`), streaming rank 0's output into this
    task's log; returns the TrainResult it wrote."""
    logger = get_run_logger()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_extra}
    env.setdefault("OMP_NUM_THREADS", "1")
    if os.path.exists(result_path):
        os.remove(result_path)  # never mistake an old result for this run's
    if launch is not None and launch.target == "slurm":
        ranks = nproc // launch.nodes
        spec = RunSpec(
            name=run_name(name),
            recipe=recipe_path,
            result=result_path,
            nodes=launch.nodes,
            ranks_per_node=ranks,
            cpus_per_node=launch.cpus_per_node or ranks,
            memory_gb=launch.memory_gb,
            gpus_per_node=launch.gpus_per_node,
            max_restarts=max_restarts,
            time_limit_s=timeout_s,
            partition=launch.partition,
            nodelist=tuple(launch.nodelist),
        )
        run_slurm_job(
            spec, Path(result_path).parent, timeout_s=timeout_s, env=env, on_line=logger.info, poll_s=launch.poll_s
        )
    else:
        launch_torchrun(
            recipe_path,
            nproc,
            result_path,
            timeout_s=timeout_s,
            env=env,
            on_line=logger.info,
            max_restarts=max_restarts,
        )
    if not os.path.exists(result_path):
        raise LaunchError(f"torchrun exited 0 but wrote no result to {result_path}")
    return TrainResult.load(result_path)
