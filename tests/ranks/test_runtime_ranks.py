"""Runtime under torchrun: a real two-rank launch writes its result and checkpoint and exits cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_core.common.results import TrainResult
from omni_core.runtime.ckpt_store import MANIFEST
from tests.helpers.recipes import write_recipe
from tests.helpers.runtime import worker_pid


def test_torchrun_launch_two_ranks_writes_result_and_exits_cleanly(tmp_path):
    recipe_path = write_recipe(tmp_path / "recipe.yaml", {
        "experiment.name": "launch", "data.path": tmp_path / "data", "data.synthetic.num_samples": 60,
        "parallel.nproc": 2, "train.steps": 4, "train.log_every": 2, "train.ckpt_every": 2, "train.dist_timeout_s": 60,
    }, tmp_path / "out")
    result_path = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_RUN_ID", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "omni_core.runtime.launch", "--recipe", str(recipe_path), "--result", str(result_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = TrainResult.load(result_path)
    assert result.world_size == 2 and result.plan == "dp2" and result.steps == 4
    manifest = json.loads((Path(result.checkpoint) / MANIFEST).read_text())  # a local store
    assert manifest["world_size"] == 2 and manifest["step"] == 4
    assert (Path(result.checkpoint) / "rank1.pt").is_file()
    assert "step 4/4" in proc.stdout


def _skips_worker(rank: int, world: int, plan_name: str) -> dict[str, int]:
    from types import SimpleNamespace

    import torch

    from omni_core.common.plan import ParallelPlan
    from omni_core.runtime.dist import DistInfo
    from omni_core.runtime.trainer import skipped_over_shards

    loader = SimpleNamespace(stats={"missing_file": rank + 1, "too_long": 2})
    info = DistInfo(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"))
    return skipped_over_shards(loader, ParallelPlan.parse(plan_name), info)


def test_skip_counts_are_summed_over_data_shards_once_each():
    from omni_core.runtime.ranks import run_ranks

    assert run_ranks(_skips_worker, 2, "dp2") == [{"missing_file": 3, "too_long": 4}] * 2  # two shards
    assert run_ranks(_skips_worker, 2, "dp1-tp2") == [{"missing_file": 1, "too_long": 2}] * 2  # one shard, read twice


def test_a_rank_killed_mid_training_is_restarted_and_resumes_to_the_uninterrupted_loss(tmp_path):
    import signal
    import time

    from omni_core.runtime.targets import RunSpec, local_command

    def recipe(name: str) -> Path:  # both runs read one dataset
        return write_recipe(tmp_path / f"{name}.yaml", {
            "experiment.name": name, "data.path": tmp_path / "data", "data.synthetic.num_samples": 400,
            "parallel.nproc": 2, "train.steps": 30, "train.log_every": 10, "train.ckpt_every": 10,
            "train.dist_timeout_s": 60,
        }, tmp_path / "out")

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_RUN_ID", None)
    results = {}
    for name in ("straight", "killed"):
        spec = RunSpec(name=name, recipe=str(recipe(name)), result=str(tmp_path / f"{name}.json"), ranks_per_node=2,
                       max_restarts=1)
        proc = subprocess.Popen(local_command(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
        if name == "killed":
            manifest = tmp_path / "out" / name
            deadline = time.monotonic() + 240
            while not any(manifest.rglob(f"step_000010/{MANIFEST}")):  # killed after its first checkpoint
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            pid = worker_pid(spec.recipe, 1)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output[-3000:]
        results[name] = (TrainResult.load(spec.result), output)
    killed, output = results["killed"]
    assert "resumed from" in output and killed.resumed_from_step >= 10  # torchrun restarted every rank
    assert killed.steps == 30
    assert abs(killed.final_loss - results["straight"][0].final_loss) < 1e-6


def test_a_failed_launch_ends_with_the_failing_rank_s_own_error(tmp_path):
    """The launch checks would refuse this recipe; launched anyway, the ranks' error is the last line."""
    from omni_core.runtime.supervisor import LaunchError, launch_torchrun

    recipe_path = write_recipe(tmp_path / "recipe.yaml", {
        "experiment.name": "fails", "model.flavor": "nope", "parallel.nproc": 2, "train.steps": 2,
        "train.warmup_steps": 1, "train.dist_timeout_s": 30,
    }, tmp_path / "out")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with pytest.raises(LaunchError) as failed:
        launch_torchrun(str(recipe_path), 2, str(tmp_path / "result.json"), timeout_s=120, env=env,
                        on_line=lambda line: None)
    last = str(failed.value).splitlines()[-1]
    assert last.startswith("rank ") and " failed first: ValueError: unknown model flavor 'nope'" in last
