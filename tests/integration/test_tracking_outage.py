"""The MLflow server killed while a training runs and started again: the training neither stops nor fails, and
every metric it logged reaches the run (queued while the server was away, or replayed by the train stage)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from omni_core.runtime.ranks import free_port
from omni_core.runtime.supervisor import terminate_group
from tests.helpers.recipes import write_recipe
from tests.servers import server_process

BIN = Path(sys.executable).parent
OUTAGE = {"experiment.name": "outage", "data.synthetic.num_samples": 200, "data.seq_len": 256, "parallel.nproc": 1,
          "train.steps": 120, "train.log_every": 4, "train.ckpt_every": 0, "train.timeout_s": 600,
          "tracking.flush_every_s": 0.5}


def train_steps_logged(url: str) -> list[int]:
    from mlflow import MlflowClient

    client = MlflowClient(url)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.info.run_name == "train"]
    return sorted(m.step for r in runs for m in client.get_metric_history(r.info.run_id, "train/loss"))


def mlflow_server(tmp_path: Path) -> tuple[str, list[str], dict[str, str], dict[str, str]]:
    """An MLflow server's URL and command on a free loopback port (started and killed by the test, as often as
    it likes), the server's environment, and the environment without the session's tracking servers."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")}
    server = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
              "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
              "--default-artifact-root", str(tmp_path / "artifacts")]
    return f"http://127.0.0.1:{port}", server, {**base, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, base


def test_training_outlives_the_tracking_server_and_loses_no_metric(tmp_path, prefect_api_url):
    url, server, server_env, base = mlflow_server(tmp_path)
    write_recipe(tmp_path / "recipe.yaml", OUTAGE, tmp_path / "out")
    env = {**base, "MLFLOW_TRACKING_URI": url, "PREFECT_API_URL": prefect_api_url, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "omni.log"
    with server_process(server, f"{url}/health", log=tmp_path / "mlflow-1.log", env=server_env):
        with open(log, "w") as out:
            training = subprocess.Popen([str(BIN / "omni"), "train", str(tmp_path / "recipe.yaml")], cwd=tmp_path,
                                        env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while not train_steps_logged(url):
            assert training.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
    # the server is gone (its process group killed); training goes on without it while it starts again
    try:
        time.sleep(1)
        assert training.poll() in (None, 0), log.read_text()[-3000:]
        with server_process(server, f"{url}/health", log=tmp_path / "mlflow-2.log", env=server_env):
            assert training.wait(timeout=600) == 0, log.read_text()[-4000:]
            assert train_steps_logged(url) == list(range(4, 121, 4))
            result = json.loads(next((tmp_path / "out").rglob("train_result.json")).read_text())
            assert result["steps"] == 120
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                pass
    finally:
        terminate_group(training, grace_s=15)
    assert "unreachable" in log.read_text()


def test_a_server_still_away_when_training_ends_gets_its_statuses_and_metrics_later(tmp_path, prefect_api_url,
                                                                                       monkeypatch):
    """The server dies mid-training and is still away when training ends: `omni train` gives up on logging the
    checkpoint after tracking.reconnect_timeout_s with one clear message, keeps the run's end and its unsent
    metrics in $OMNI_HOME, and the next stage that reaches the server (a profile flow, here in the test's own
    process) settles both: the run is not left RUNNING and no metric is lost."""
    from mlflow import MlflowClient

    from flows.profile import profile_flow
    from omni_core.tracking import pending

    url, server, server_env, base = mlflow_server(tmp_path)
    recipe = write_recipe(tmp_path / "recipe.yaml", {**OUTAGE, "train.steps": 60, "tracking.reconnect_timeout_s": 2},
                          tmp_path / "out")
    env = {**base, "MLFLOW_TRACKING_URI": url, "PREFECT_API_URL": prefect_api_url, "OMP_NUM_THREADS": "1",
           "OMNI_HOME": str(tmp_path / "omni-home")}
    log = tmp_path / "omni.log"
    with server_process(server, f"{url}/health", log=tmp_path / "mlflow-1.log", env=server_env):
        with open(log, "w") as out:
            training = subprocess.Popen([str(BIN / "omni"), "train", str(recipe)], cwd=tmp_path, env=env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while not train_steps_logged(url):
            assert training.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
    try:
        assert training.wait(timeout=600) == 2, log.read_text()[-4000:]
    finally:
        terminate_group(training, grace_s=15)
    assert "training finished (60 steps" in log.read_text() and "stayed unreachable" in log.read_text()
    monkeypatch.chdir(tmp_path)  # where `omni train` ran: the recipe's relative data folder
    monkeypatch.setenv("OMNI_HOME", env["OMNI_HOME"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    left = pending(url)
    assert {e["kind"] for e in left} == {"replay", "finish"}, left
    assert [e["status"] for e in left if e["kind"] == "finish"] == ["FAILED"]

    with server_process(server, f"{url}/health", log=tmp_path / "mlflow-2.log", env=server_env):
        profile_flow(str(recipe))
        assert train_steps_logged(url) == list(range(4, 61, 4))
        client = MlflowClient(url)
        [train] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
                   if r.info.run_name == "train"]
        assert train.info.status == "FAILED" and train.info.end_time is not None
    assert pending(url) == []
