"""Deployments against a real `prefect server` on loopback: `omni serve` serves a deployment with a short
interval schedule, which creates and completes flow runs, and a training whose cancellation leaves no process
behind and its MLflow run KILLED; `omni deploy` registers every deployment of a prefect.yaml with a process
work pool, whose worker runs one, and the repository's prefect.yaml with a Kubernetes work pool of omni's base
job template (no cluster: what the pool and its deployments hold is checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from omni_core.runtime.ranks import free_port
from omni_core.runtime.supervisor import terminate_group
from tests.helpers.recipes import write_recipe
from tests.servers import server_process

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
SERVED = {"experiment.name": "served", "data.synthetic.num_samples": 40, "data.seq_len": 256, "parallel.nproc": 1}
DEPLOYMENTS = """\
deployments:
  - name: profile-often
    entrypoint: flows.profile:profile_flow
    parameters: {recipe: recipe.yaml, overrides: ["data.synthetic.num_samples=30"]}
    schedules: [{interval: 5}]
    concurrency_limit: {limit: 1, collision_strategy: ENQUEUE}
  - name: train-long
    entrypoint: flows.train:train_flow
    parameters: {recipe: recipe.yaml, overrides: ["train.steps=100000", "train.ckpt_every=0"]}
"""


def api(url: str, path: str, body: dict | None = None, attempts: int = 6) -> object:
    """POST to the Prefect server's API. A 429 or 503 (the server's sqlite store busy under load) is retried
    with backoff, as Prefect's own client retries them."""
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            if error.code not in (429, 503) or attempt == attempts - 1:
                raise
        time.sleep(0.5 * 2 ** attempt)


def runs_of(url: str, deployment: str) -> list[dict]:
    runs = api(url, "/flow_runs/filter")
    ids = {d["id"] for d in api(url, "/deployments/filter") if d["name"] == deployment}
    return [r for r in runs if r["deployment_id"] in ids]


def wait_for(predicate, timeout_s: float, what: str, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(1)
    raise AssertionError(f"{what} within {timeout_s} s; log:\n{log.read_text()[-4000:]}")


def training_processes(recipe_dir: Path) -> list[int]:
    """Processes of a launch whose command line names a file under `recipe_dir` (read from /proc)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"omni_core.runtime.launch" in cmdline and str(recipe_dir).encode() in cmdline:
            found.append(int(proc.name))
    return found


def cancel_a_served_training(url: str, tmp_path: Path, log: Path) -> None:
    [deployment] = [d for d in api(url, "/deployments/filter") if d["name"] == "train-long"]
    run = api(url, f"/deployments/{deployment['id']}/create_flow_run", {})
    wait_for(lambda: training_processes(tmp_path), 240, "the served training started", log)
    api(url, f"/flow_runs/{run['id']}/set_state", {"state": {"type": "CANCELLING"}, "force": True})
    wait_for(lambda: api(url, "/flow_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}})[0]["state_type"]
             == "CANCELLED", 120, "the flow run cancelled", log)
    wait_for(lambda: not training_processes(tmp_path), 60, "no training process left", log)


def stop_serving(serving: subprocess.Popen, url: str, log: Path) -> None:
    """SIGTERM to `omni serve` alone, as a service manager stops it: Prefect's runner cancels the flow run it is
    executing (a profile run, every 5 s), so no run is left RUNNING to hold its deployment's concurrency slot
    (killing the whole process group at once would, and the worker below could then start none)."""
    import signal

    serving.send_signal(signal.SIGTERM)
    assert serving.wait(timeout=180) == 0, log.read_text()[-3000:]
    wait_for(lambda: not [r for r in runs_of(url, "profile-often") if r["state_type"] in ("RUNNING", "PENDING")],
             60, "no served run left running", log)


def test_served_and_deployed_flows_run_on_a_prefect_server(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    base = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")}
    write_recipe(tmp_path / "recipe.yaml", SERVED, tmp_path / "out")
    (tmp_path / "prefect.yaml").write_text(DEPLOYMENTS)
    server = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with server_process(server, f"{url}/health", log=tmp_path / "server.log",
                        env={**base, "PREFECT_HOME": str(tmp_path / "prefect-server")}):
        # the runner and the worker look for runs every 2 s (Prefect's default is 10)
        env = {**base, "PREFECT_API_URL": url, "PREFECT_HOME": str(tmp_path / "prefect-client"),
               "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "OMP_NUM_THREADS": "1",
               "PREFECT_RUNNER_POLL_FREQUENCY": "2", "PREFECT_WORKER_QUERY_SECONDS": "2"}
        log = tmp_path / "serve.log"
        with open(log, "w") as out:
            serving = subprocess.Popen([str(BIN / "omni"), "serve", "--file", str(tmp_path / "prefect.yaml")],
                                       cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            done = wait_for(lambda: [r for r in runs_of(url, "profile-often") if r["state_type"] == "COMPLETED"],
                            240, "a served flow run completed", log)
            assert done[0]["parameters"] == {"recipe": str(tmp_path / "recipe.yaml"),
                                             "overrides": ["data.synthetic.num_samples=30"]}
            cancel_a_served_training(url, tmp_path, log)
            from mlflow import MlflowClient

            client = MlflowClient(env["MLFLOW_TRACKING_URI"])
            [train] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
                       if r.info.run_name == "train"]
            assert train.info.status == "KILLED"
            stop_serving(serving, url, log)
        finally:
            terminate_group(serving, grace_s=15)

        log = tmp_path / "deploy.log"
        # deployments of their own: the served ones' schedules have queued runs, and a served run killed with
        # `omni serve` could hold its deployment's concurrency slot until Prefect's lease lapses (300 s)
        pooled = tmp_path / "prefect-pooled.yaml"
        pooled.write_text(DEPLOYMENTS.replace("name: profile-often", "name: profile-pooled")
                          .replace("name: train-long", "name: train-pooled"))
        deployed = subprocess.run([str(BIN / "omni"), "deploy", "--file", str(pooled),
                                   "--pool", "omni-test"], cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=120)
        assert deployed.returncode == 0, deployed.stderr[-3000:]
        pools = api(url, "/work_pools/filter")
        assert {p["name"]: p["type"] for p in pools}.get("omni-test") == "process"
        registered = [d for d in api(url, "/deployments/filter") if d["work_pool_name"] == "omni-test"]
        assert sorted(d["name"] for d in registered) == ["profile-pooled", "train-pooled"]
        with open(log, "w") as out:
            worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", "omni-test"], cwd=tmp_path,
                                      env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: [r for r in runs_of(url, "profile-pooled") if r["state_type"] == "COMPLETED"],
                     240, "a worker's flow run completed", log)
        finally:
            terminate_group(worker, grace_s=15)
        deploy_to_kubernetes(url, tmp_path, env)


def deploy_to_kubernetes(url: str, tmp_path: Path, env: dict[str, str]) -> None:
    """The shipped deployments go to a Kubernetes pool with the template the worker starts Jobs from, their
    recipes relative to the image's checkout; a prefect.yaml whose recipe the image lacks is refused."""
    omni_deploy = [str(BIN / "omni"), "deploy", "--pool", "omni-k8s", "--type", "kubernetes"]
    deployed = subprocess.run(omni_deploy, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    [pool] = [p for p in api(url, "/work_pools/filter") if p["name"] == "omni-k8s"]
    template = json.loads((REPO / "infra" / "k8s" / "base-job-template.json").read_text())
    assert pool["type"] == "kubernetes" and pool["base_job_template"] == template
    registered = {d["name"]: d["parameters"] for d in api(url, "/deployments/filter") if d["work_pool_name"] == "omni-k8s"}
    assert registered["nightly-regression"] == {"recipe": "recipes/nightly_regression.yaml", "overrides": []}
    assert set(registered) == {"nightly-regression", "reprofile", "adhoc"}

    outside = subprocess.run([*omni_deploy, "--file", str(tmp_path / "prefect.yaml")], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
    assert outside.returncode == 2 and "is outside this repository" in outside.stderr, outside.stderr[-2000:]
