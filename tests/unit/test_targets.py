"""One RunSpec rendered for a local process group, Kubernetes and Slurm; the manifests validated against the
Kubernetes API's own schemas (kubernetes-validate, offline), the script by bash's parser."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from omni_core.runtime.targets import (
    RunSpec,
    kubernetes_manifests,
    local_command,
    run_name,
    slurm_script,
    torchrun_args,
    trainjob_manifest,
)

SPEC = RunSpec(name="llava-12b", recipe="/omni/recipes/r.yaml", result="/out/train_result.json", nodes=2,
               ranks_per_node=8, gpus_per_node=8, cpus_per_node=64, memory_gb=512,
               env={"MLFLOW_TRACKING_URI": "http://mlflow:5000", "MLFLOW_RUN_ID": "abc"})


def test_local_launch_is_standalone_torchrun():
    spec = RunSpec(name="local", recipe="r.yaml", result="out.json", ranks_per_node=2)
    assert local_command(spec) == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                   "2", "--max-restarts", "0", "-m", "omni_core.runtime.launch", "--recipe", "r.yaml", "--result", "out.json"]
    with pytest.raises(ValueError, match="a local launch is one node"):
        local_command(SPEC)


def test_kubernetes_manifests_are_valid_and_meet_on_pod_zero():
    import kubernetes_validate

    service, job = kubernetes_manifests(SPEC)
    for manifest in (service, job):
        kubernetes_validate.validate(yaml.safe_load(yaml.safe_dump(manifest)), "1.30.0", strict=True)
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2 and pod["subdomain"] == service["metadata"]["name"]
    command = pod["containers"][0]["command"]
    assert command[:1] == ["torchrun"] and "llava-12b-0.llava-12b:29400" in command
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_kubernetes_validation_catches_a_broken_manifest():
    import kubernetes_validate

    _, job = kubernetes_manifests(SPEC)
    job["spec"]["completions"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, "1.30.0", strict=True)


def train_job_schema_problems(manifest: dict) -> list[str]:
    """What Kubeflow Trainer's TrainJob models (its OpenAPI schema, from kubeflow-trainer-api) reject or drop:
    a wrong type raises, an unknown field is dropped, so the round trip differs."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    parsed = TrainerV1alpha1TrainJob.from_dict(manifest).to_dict()
    return [f"{key}: {manifest.get(key)!r} became {parsed.get(key)!r}" for key in manifest if parsed.get(key) != manifest[key]]


def test_a_train_job_is_valid_and_leaves_the_rendezvous_to_the_trainer_runtime():
    from pydantic import ValidationError

    manifest = trainjob_manifest(replace(SPEC, time_limit_s=7200, max_restarts=2))
    assert train_job_schema_problems(manifest) == []
    trainer = manifest["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], manifest["spec"]["activeDeadlineSeconds"]) == (2, 8, 7200)
    assert trainer["command"][:3] == ["torchrun", "--max-restarts", "2"] and "--nnodes" not in trainer["command"]
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"
    assert manifest["spec"]["runtimeRef"] == {"name": "torch-distributed"}
    misspelt = {**manifest, "spec": {**manifest["spec"], "trainer": {**trainer, "numNode": 2}}}
    [problem] = train_job_schema_problems(misspelt)
    given, parsed = problem.split(" became ")
    assert problem.startswith("spec: ") and "'numNode': 2" in given and "numNode'" not in parsed
    with pytest.raises(ValidationError):
        train_job_schema_problems({**manifest, "spec": {**manifest["spec"], "trainer": {**trainer, "numNodes": "2"}}})


def test_slurm_script_parses_and_runs_one_torchrun_per_node(tmp_path):
    script = slurm_script(SPEC)
    (tmp_path / "job.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert 'srun torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$head":29400 --rdzv-id llava-12b --max-restarts 0' in script
    assert torchrun_args(SPEC, "h:1")[-4:] == ["--recipe", "/omni/recipes/r.yaml", "--result", "/out/train_result.json"]


def test_the_wall_clock_limit_and_partition_reach_the_cluster():
    """Slurm and the Job enforce the launch's limit themselves (the train stage's follower cancels too)."""
    spec = RunSpec(name="r", recipe="r.yaml", result="o.json", time_limit_s=3601, partition="gpu-a100")
    script = slurm_script(spec, ("/venv/bin/python", "-m", "torch.distributed.run"))
    assert "#SBATCH --time=61" in script and "#SBATCH --partition=gpu-a100" in script
    assert "srun /venv/bin/python -m torch.distributed.run --standalone" in script
    assert kubernetes_manifests(spec)[1]["spec"]["activeDeadlineSeconds"] == 3601
    assert "--time" not in slurm_script(RunSpec(name="r", recipe="r.yaml", result="o.json"))
    pinned = RunSpec(name="r", recipe="r.yaml", result="o.json", nodes=2, nodelist=("n2", "n3"))
    assert "#SBATCH --nodelist=n2,n3" in slurm_script(pinned) and "--nodelist" not in script
    assert run_name("Crius_Study.v2") == "crius-study-v2" and run_name("__") == "omni"


def test_a_slurm_launch_without_slurm_is_refused_before_it_starts(tmp_path, monkeypatch):
    from omni_core.recipe import RecipeError
    from omni_core.runtime.preflight import check_launch
    from tests.helpers.recipes import build_recipe

    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    recipe = build_recipe(tmp_path, {"experiment.name": "x", "launch.target": "slurm"})
    with pytest.raises(RecipeError, match="launch.target: slurm needs sbatch, scontrol, scancel, sinfo on PATH"):
        check_launch(recipe)
    with pytest.raises(RecipeError, match="launch.nodes=3 must divide parallel.nproc=1"):
        build_recipe(tmp_path, {"experiment.name": "x", "launch.target": "slurm", "launch.nodes": 3})


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "Big_Run"}, "lower-case letters"), ({"nodes": 0}, "nodes=0 must be >= 1"),
    ({"ranks_per_node": 8, "gpus_per_node": 4}, "8 ranks per node on 4 GPUs"),
])
def test_bad_specs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RunSpec(**{"name": "r", "recipe": "r.yaml", "result": "o.json", **kwargs})


def test_omni_render_prints_a_recipes_launch_for_a_cluster(capsys):
    from flows.cli import main

    quickstart = str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml")
    assert main(["render", quickstart, "--target", "kubernetes", "--nodes", "2",
                 "--set", "train.max_restarts=2"]) == 0
    service, job = yaml.safe_load_all(capsys.readouterr().out)
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert service["kind"] == "Service" and job["spec"]["completions"] == 2
    assert command[command.index("--nproc-per-node") + 1] == "1" and command[command.index("--max-restarts") + 1] == "2"
    assert command[-2:] == ["--set", "train.max_restarts=2"]
    assert main(["render", quickstart, "--target", "slurm", "--nodes", "3"]) == 2
    assert "parallel.nproc=2 ranks do not split over --nodes 3" in capsys.readouterr().err
