"""The train stage on a real Slurm cluster (`launch.target: slurm`): a one-node cluster on loopback
(tests.servers.slurm_cluster: MUNGE, slurmctld, slurmd), the job submitted with sbatch, followed, and cancelled
when it must be; and the schedule stage placing its jobs on a two-node cluster's nodes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_core.runtime.slurm import job_state, run_slurm_job
from omni_core.runtime.supervisor import LaunchError, terminate_group
from omni_core.runtime.targets import RunSpec
from tests.helpers.recipes import write_recipe
from tests.servers import slurm_cluster

# two ranks trained as one Slurm job (train.steps set by each test), as overrides of tests.helpers.recipes' base
SLURM = {"experiment.name": "slurm_test", "experiment.seed": 0, "data.synthetic.num_samples": 60, "data.seq_len": 256,
         "model.flavor": "debug", "parallel.nproc": 2, "train.warmup_steps": 2, "train.log_every": 2,
         "train.ckpt_every": 0, "train.timeout_s": 300, "train.dist_timeout_s": 60, "eval.max_batches": 2,
         "launch.target": "slurm", "launch.memory_gb": 2, "launch.poll_s": 0.5}


@pytest.fixture(scope="module")
def slurm():
    with slurm_cluster() as env, pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        yield env


def test_the_train_stage_trains_as_a_slurm_job(slurm, tmp_path, mlflow_uri, prefect_harness):
    """sbatch of the rendered script, torchrun on the allocation, the result and checkpoint back on the shared
    filesystem, rank 0's output streamed into the stage's log, the MLflow run finished."""
    from mlflow import MlflowClient

    from flows.train import train_flow

    result = train_flow(str(write_recipe(tmp_path / "recipe.yaml", {**SLURM, "train.steps": 6}, tmp_path / "out")))
    assert result.steps == 6 and result.world_size == 2 and Path(result.checkpoint).is_dir()
    run_dir = next((tmp_path / "out").glob("slurm_test/runs/*"))  # flows.stage_dir
    outputs = list(run_dir.glob("slurm-test-*.out"))
    assert (run_dir / "slurm-test.sbatch").is_file() and len(outputs) == 1
    assert "step 6/6" in outputs[0].read_text()
    job = outputs[0].stem.removeprefix("slurm-test-")
    assert job_state(job, os.environ)[0] == "COMPLETED"
    client = MlflowClient(mlflow_uri)
    run, = client.search_runs([client.get_experiment_by_name("slurm_test").experiment_id],
                              "attributes.run_name = 'train'")
    assert run.info.status == "FINISHED" and run.data.metrics["train/loss"] > 0  # the ranks logged into it


def test_a_slurm_job_past_its_limit_is_cancelled_and_leaves_no_process(slurm, tmp_path):
    recipe = write_recipe(tmp_path / "recipe.yaml", {**SLURM, "train.steps": 100_000}, tmp_path / "out")
    spec = RunSpec(name="too-long", recipe=str(recipe), result=str(tmp_path / "r.json"), ranks_per_node=2, memory_gb=2)
    lines: list[str] = []
    # The limit leaves the job time to print its first steps while the other test stream keeps both cores busy.
    with pytest.raises(LaunchError, match="exceeded its 40s limit and was cancelled") as failure:
        run_slurm_job(spec, tmp_path / "job", timeout_s=40, env={**os.environ, "OMP_NUM_THREADS": "1"},
                      on_line=lines.append, poll_s=0.5)
    assert not failure.value.infrastructure
    job = lines[0].split()[2]
    assert job_state(job, os.environ)[0] == "CANCELLED"
    assert any(line.startswith("step ") for line in lines), "the job trained and its output was streamed"
    left = subprocess.run(["pgrep", "-f", "omni_core.runtime.launch --recipe " + spec.recipe], capture_output=True)
    assert left.returncode == 1, f"processes left behind: {left.stdout!r}"


def test_a_cancelled_train_stage_cancels_its_slurm_job(slurm, tmp_path, prefect_api_url):
    """SIGTERM to the stage's process, as Prefect's runner cancels a flow run: the job is scancelled, no rank is
    left on the node, and the MLflow run is KILLED."""
    from mlflow import MlflowClient

    recipe = write_recipe(tmp_path / "recipe.yaml", {**SLURM, "train.steps": 100_000}, tmp_path / "out")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}, "OMP_NUM_THREADS": "1",
           "MLFLOW_TRACKING_URI": store, "PREFECT_API_URL": prefect_api_url}
    log = tmp_path / "omni.log"
    with log.open("w") as out:
        stage = subprocess.Popen([str(Path(sys.executable).parent / "omni"), "train", str(recipe)], env=env,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not any("step " in o.read_text() for o in (tmp_path / "out").glob("**/slurm-test-*.out")):
            assert stage.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        stage.send_signal(signal.SIGTERM)
        assert stage.wait(timeout=120) != 0
    finally:
        terminate_group(stage, grace_s=10)
    output, = (tmp_path / "out").glob("**/slurm-test-*.out")
    assert job_state(output.stem.removeprefix("slurm-test-"), os.environ)[0] == "CANCELLED"
    left = subprocess.run(["pgrep", "-f", "omni_core.runtime.launch --recipe " + str(recipe)], capture_output=True)
    assert left.returncode == 1, f"processes left behind: {left.stdout!r}"
    client = MlflowClient(store)
    run, = client.search_runs([client.get_experiment_by_name("slurm_test").experiment_id],
                              "attributes.run_name = 'train'")
    assert run.info.status == "KILLED"


def test_a_failed_slurm_job_ends_with_its_output(slurm, tmp_path):
    """The ranks' own error reaches the LaunchError, which is not an infrastructure failure (no retry)."""
    recipe = write_recipe(tmp_path / "recipe.yaml", {**SLURM, "train.steps": 4, "data.source": "jsonl",
                                                     "data.path": tmp_path / "missing"}, tmp_path / "out")
    spec = RunSpec(name="fails", recipe=str(recipe), result=str(tmp_path / "r.json"), ranks_per_node=2, memory_gb=2)
    with pytest.raises(LaunchError, match=r"ended FAILED \(exit code [1-9]") as failure:
        run_slurm_job(spec, tmp_path / "job", timeout_s=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
                      poll_s=0.5, on_line=lambda line: None)
    assert "does not exist" in str(failure.value) and not failure.value.infrastructure


@pytest.mark.usefixtures("uncalibrated")
def test_the_schedule_stage_places_its_jobs_on_slurm_nodes_and_they_run_there(tmp_path, mlflow_uri, prefect_harness,
                                                                              monkeypatch):
    """Real mode on two one-CPU Slurm nodes (two slurmd on this host): a alone takes both, one rank per node, its
    torchruns meeting by c10d at the first node's address; when b arrives, a shrinks to one node at its
    segment's end and b runs on the other at the same time. Each sbatch job ran on the nodes it was placed on."""
    from flows.schedule import schedule_flow
    from omni_core.recipe import RecipeError, load_recipe
    from omni_core.runtime.preflight import check_launch
    from tests.helpers.schedule_real import SCHEDULED, assert_never_double_booked

    recipe = write_recipe(tmp_path / "recipe.yaml", {
        **SCHEDULED, "launch.target": "slurm", "launch.memory_gb": 1, "launch.poll_s": 0.5,
        "cluster.name": "two-nodes", "cluster.slots": 0,
        "cluster.node_groups": [{"gpu_type": "cpu", "nodes": 2, "gpus_per_node": 1, "hosts": ["n1", "n2"]}],
    }, tmp_path / "out")
    with slurm_cluster(nodes=2) as cluster:
        monkeypatch.setenv("SLURM_CONF", cluster["SLURM_CONF"])
        with pytest.raises(RecipeError, match=r"node_groups\.0\.hosts: n3: no such node in the Slurm cluster"):
            check_launch(load_recipe(recipe, ["cluster.node_groups.0.hosts=[n1, n3]"]))
        result = schedule_flow(str(recipe))
        ran_on = {}
        for output in (tmp_path / "out").glob("sched-test-*/runs/*/sched-test-*.out"):  # a job is its experiment
            assert "done: loss" in output.read_text()
            job = output.stem.rsplit("-", 1)[1]
            fields = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
            ran_on[output.stem.split("-")[2], int(job)] = next(f for f in fields.split() if f.startswith("NodeList="))
    a1, a2, b1 = sorted(result.segments, key=lambda s: (s.job, s.segment))
    assert [(s.num_gpus, s.nodes) for s in (a1, a2, b1)] == [(2, [0, 1]), (1, [0]), (1, [1])]
    assert result.results["a"].steps == 6 and result.results["a"].world_size == 1
    assert a2.start_s < b1.end_s and b1.start_s < a2.end_s  # side by side on the cluster
    assert_never_double_booked(result, 2)
    assert [where for _, where in sorted(ran_on.items())] == ["NodeList=n[1-2]", "NodeList=n1", "NodeList=n2"]
