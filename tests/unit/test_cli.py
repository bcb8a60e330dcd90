"""omni CLI: help a first-time user can act on, recipe checks, one-line errors, no heavy imports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from omni_core.recipe import load_recipe, recipe_hash
from omni_core.runtime.preflight import may_have_gpus
from tests.helpers.recipes import write_recipe

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"

IMPORT_PROBE = """\
import sys
from flows.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("HEAVY", sorted(m for m in ("torch", "mlflow", "prefect") if m in sys.modules))
sys.exit(code)
"""


@pytest.fixture
def recipe_file(tmp_path):
    return write_recipe(tmp_path / "r.yaml", {"experiment.name": "cli-test", "train.steps": 5})  # output in ./runs


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", IMPORT_PROBE, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"]])
def test_help_imports_no_heavy_packages(args):
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout


def test_recipe_check_imports_neither_mlflow_nor_prefect(recipe_file):
    out = run_cli("recipe", "check", str(recipe_file))
    assert out.returncode == 0, out.stderr
    heavy = out.stdout.rsplit("HEAVY ", 1)[1]
    assert "mlflow" not in heavy and "prefect" not in heavy


def test_recipe_check_of_the_quickstart_imports_no_torch(tmp_path):
    if may_have_gpus():
        pytest.skip("a GPU driver is here: the device check asks torch how many GPUs there are")
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE, "recipe", "check", str(QUICKSTART)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # in tmp_path: no dataset generated yet
    assert out.returncode == 0, out.stderr
    assert "torch" not in out.stdout.rsplit("HEAVY ", 1)[1]


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "flows.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("run", "profile", "train", "evaluate", "recipe"):
        assert command in out.stdout


def test_run_help_explains_what_a_first_time_user_needs(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for needle in [
        "profile", "train", "evaluate",  # the stages
        "checkpoints", "mlflow.db", "mlartifacts", "runs",  # where things go
        "mlflow ui", "http://127.0.0.1:5000",  # how to browse
        "--set train.steps=50", "KEY=VALUE",  # overrides
        "MLFLOW_TRACKING_URI", "PREFECT_API_URL", "AWS_ACCESS_KEY_ID", "MLFLOW_S3_ENDPOINT_URL",
        "--json",
    ]:  # fmt: skip
        assert needle in text, needle


def test_recipe_check_prints_ok_and_the_hash(recipe_file, capsys):
    assert main(["recipe", "check", str(recipe_file), "--set", "train.steps=7"]) == 0
    expected = recipe_hash(load_recipe(recipe_file, ["train.steps=7"]))
    assert capsys.readouterr().out == f"ok {expected}\n"


def test_recipe_show_prints_the_resolved_yaml_and_hash(recipe_file, capsys):
    assert main(["recipe", "show", str(recipe_file), "--set", "train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["train"]["steps"] == 7
    *_, hash_line, plan_line = out.rstrip().splitlines()
    assert hash_line == f"# recipe.hash: {recipe_hash(load_recipe(recipe_file, ['train.steps=7']))}"
    assert plan_line.startswith("# parallel plan: ")


def test_bad_recipe_is_one_message_and_exit_2(recipe_file, capsys):
    assert main(["recipe", "check", str(recipe_file), "--set", "train.stepz=1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "train.stepz" in captured.err and "Traceback" not in captured.err


def test_recipe_check_refuses_a_study_trace_it_could_not_replay(recipe_file, tmp_path, capsys):
    """Read only at `omni simulate`, a study's trace is checked by `omni recipe check` too, at its line."""
    trace = tmp_path / "jobs.csv"
    trace.write_text("job_id,submission_time,duration\nj,0,60\n")  # ITP's columns but num_gpu
    assert main(["recipe", "check", str(recipe_file), "--set", f"schedule.trace={tmp_path / 'none.csv'}"]) == 2
    assert "schedule.trace: no such file" in capsys.readouterr().err
    assert main(["recipe", "check", str(recipe_file), "--set", f"schedule.trace={trace}"]) == 2
    assert "schedule.trace: " in capsys.readouterr().err
    assert main(["recipe", "check", str(recipe_file), "--set", f"schedule.trace={trace}",
                 "--set", "schedule.trace_format=itp"]) == 2
    assert f"schedule.trace_format: itp: {trace}:1 lacks the column(s) num_gpu" in capsys.readouterr().err
    trace.write_text("job_id,submission_time,duration,num_gpu\nj,0,60,2\n")
    assert main(["recipe", "check", str(recipe_file), "--set", f"schedule.trace={trace}"]) == 0


def test_missing_recipe_file_exit_2(tmp_path):
    out = run_cli("recipe", "check", str(tmp_path / "missing.yaml"))
    assert out.returncode == 2
    assert "missing.yaml" in out.stderr and "Traceback" not in out.stderr


def test_a_cells_file_that_is_no_celltable_is_one_message_before_training(recipe_file, tmp_path, monkeypatch,
                                                                          capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cells.json").write_text('{"cells": 3, "unfit": []}')
    assert main(["train", str(recipe_file), "--cells", "cells.json"]) == 2
    err = capsys.readouterr().err
    assert "--cells cells.json: not a CellTable" in err and "Traceback" not in err
    assert not (tmp_path / "mlruns").exists() and not list(tmp_path.glob("runs"))  # nothing started


def test_unreachable_tracking_server_stops_run_before_anything_starts(recipe_file, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    out = run_cli("run", str(recipe_file))
    assert out.returncode == 2
    assert f"http://127.0.0.1:{port} is not reachable" in out.stderr
    assert "Traceback" not in out.stderr
    heavy = out.stdout.rsplit("HEAVY ", 1)[1]
    assert "mlflow" not in heavy and "prefect" not in heavy  # failed before Prefect or MLflow were loaded


def test_bad_usage_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run"])
    assert info.value.code == 2
    assert "RECIPE" in capsys.readouterr().err


SUMMARY = {
    "parent_run_id": "abc123",
    "run_name": "cli-test-vague-owl",
    "tracking_uri": "sqlite:////data/mlflow.db",
    "experiment_name": "cli-test",
    "recipe_hash": "0123abcd",
    "profile": {"total_samples": 60},
    "train": {"steps": 5, "initial_loss": 5.5, "final_loss": 3.2, "tokens_per_s": 3400.0, "plan": "dp2",
              "checkpoint": "runs/cli-test/checkpoints/step_000005"},
    "evaluate": {"loss": 2.5, "perplexity": 12.1, "per_modality": {"text": {"loss": 2.4}, "image": {"loss": 2.7}},
                 "task": {"image": {"samples": 4, "answer_exact_match": 0.25, "answer_token_f1": 0.5}}},
}  # fmt: skip


@pytest.fixture
def fake_experiment_flow(monkeypatch):
    """The flow itself is covered by test_flows; these tests cover only what the CLI prints."""
    import flows.experiment

    def fake_flow(recipe, overrides):
        print("log line from a flow")
        return SUMMARY

    monkeypatch.setattr(flows.experiment, "experiment_flow", fake_flow)


def test_run_json_summary_is_the_last_stdout_line(recipe_file, fake_experiment_flow, capsys):
    assert main(["run", str(recipe_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == SUMMARY


def test_run_prints_a_readable_summary_with_how_to_browse(recipe_file, fake_experiment_flow, capsys):
    assert main(["run", str(recipe_file)]) == 0
    out = capsys.readouterr().out
    assert "cli-test-vague-owl (abc123)" in out and "loss 5.500 -> 3.200" in out and "image 2.700" in out
    assert "image answers: exact 0.25, token F1 0.50 (4 generated)" in out
    assert "mlflow ui --backend-store-uri sqlite:////data/mlflow.db" in out


@pytest.mark.parametrize("command", ["run", "profile", "train", "evaluate", "schedule", "validate", "watch"])
def test_every_flow_command_runs_the_launch_checks_first(command, recipe_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([command, str(recipe_file), "--set", "model.flavor=nope", "--set", "parallel.tp=3"]) == 2
    err = capsys.readouterr().err
    assert "--set model.flavor=nope: model.flavor: unknown model flavor 'nope'" in err and "Traceback" not in err
    assert not list(tmp_path.glob("runs")) and not (tmp_path / "mlflow.db").exists()  # nothing started


def test_recipe_check_exits_2_on_what_only_a_launch_used_to_find(recipe_file, capsys):
    assert main(["recipe", "check", str(recipe_file), "--set", "parallel.nproc=2", "--set", "parallel.tp=3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--set parallel.tp=3: parallel: world size 2 is not divisible by" in captured.err


def test_more_ranks_than_cores_is_a_warning_from_check_and_run(recipe_file, fake_experiment_flow, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("on GPUs a rank per GPU is checked instead")
    cores = len(os.sched_getaffinity(0))
    nproc = cores + 1
    warning = f"--set parallel.nproc={nproc}: parallel.nproc: warning: {nproc} ranks on {cores} CPU cores"
    assert main(["recipe", "check", str(recipe_file), "--set", f"parallel.nproc={nproc}"]) == 0
    captured = capsys.readouterr()
    assert warning in captured.err and captured.out.startswith("ok ")
    assert main(["run", str(recipe_file), "--set", f"parallel.nproc={nproc}"]) == 0
    captured = capsys.readouterr()
    assert warning in captured.err and "log line from a flow" in captured.out  # a warning: the run went on


def test_recipe_show_into_a_closed_pipe_prints_no_traceback(recipe_file):
    reader, writer = os.pipe()
    os.close(reader)  # `| head` that has already left
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "recipe", "show", str(recipe_file)], stdout=writer,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(writer)
    assert proc.returncode == 128 + signal.SIGPIPE
    assert proc.stderr == ""


def test_nccl_without_gpus_is_refused(recipe_file, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    assert main(["recipe", "check", str(recipe_file), "--set", "parallel.backend=nccl"]) == 2
    assert "parallel.backend: nccl needs CUDA GPUs and this machine has none" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["data.s3_endpoint_url", "tracking.uri", "train.ckpt_dir", "data.path"])
def test_a_credential_in_a_url_is_refused_and_never_echoed(field, recipe_file, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    value = "s3://key:PLANTED-SECRET@bucket/x" if field in ("train.ckpt_dir", "data.path") \
        else "http://user:PLANTED-SECRET@127.0.0.1:9"
    assert main(["run", str(recipe_file), "--set", f"{field}={value}"]) == 2
    out, err = capsys.readouterr()
    assert f"{field}: " in err and "carries credentials" in err and "***@" in err
    assert "PLANTED-SECRET" not in out + err
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert not any(b"PLANTED-SECRET" in p.read_bytes() for p in written)  # nothing started, nothing kept


def test_ctrl_c_ends_with_one_line(monkeypatch, capsys):
    import flows.commands.stages as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_flow_command", interrupted)
    assert main(["train", "whatever.yaml"]) == 128 + signal.SIGINT
    assert capsys.readouterr().err == "omni: interrupted\n"
