"""What a failure costs a training run, each case beside the same run uninterrupted, in one session.

- `rank_killed`: `kill -9` of rank 1 at step 15 of a dp2 run that checkpoints every 10 steps, under
  `torchrun --max-restarts 1` (`train.max_restarts`): torchrun restarts both ranks, which resume from that
  checkpoint. Reports the seconds from the kill to the first step trained after it (time to recover), the
  steps trained twice (those done after the checkpoint, before the kill), the wall seconds over the
  uninterrupted run and the final losses' difference.
- `tracking_outage`: the MLflow server killed once the train stage's first metrics reach it (`omni train`, one
  rank, on a Prefect server) and restarted `away_s` later; `away_s` in the report is until it answers again.
  Reports the steps trained while it was away and the step rate then
  against before, the wall seconds over the same run with the server up throughout, and the metrics lost (the
  logged steps the server does not have at the end).

    python benchmarks/failure_bench.py [--quick] --out failure_bench.json

Run it alone: the recovery times are wall seconds on this machine, noisy at a few seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from omni_core.common.results import TrainResult
from omni_core.runtime.ranks import free_port
from omni_core.runtime.supervisor import terminate_group
from omni_core.runtime.targets import RunSpec, local_command

BIN = Path(sys.executable).parent
STEP = re.compile(r"step (\d+)/(\d+)")
KILL_AT_STEP = 15


class Output:
    """A process's output read line by line as it comes, each line with the monotonic time it arrived."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def steps(self) -> list[tuple[float, int]]:
        """(arrival time, step) of every training-step line so far."""
        return [(t, int(m.group(1))) for t, line in list(self.lines) if (m := STEP.search(line))]

    def wait(self, timeout_s: float) -> str:
        self.proc.wait(timeout=timeout_s)
        self.reader.join(10)
        text = "\n".join(line for _, line in self.lines)
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.proc.args[:3]} exited {self.proc.returncode}:\n{text[-3000:]}")
        return text


def recipe_file(root: Path, name: str, body: str) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(f"experiment: {{name: {name}, output_dir: {root / 'out'}}}\n"
                    f"data: {{path: {root / 'data'}, synthetic: {{num_samples: 400}}, seq_len: 256}}\n{body}")
    return path


def rank_pid(recipe: Path, rank: int) -> int:
    """The pid of the launch's worker process with torchrun's RANK `rank` (read from /proc)."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, PermissionError):
            continue
        if b"omni_core.runtime.launch" in cmdline and str(recipe).encode() in cmdline \
                and b"--standalone" not in cmdline and f"RANK={rank}".encode() in environ:  # a worker, not torchrun
            return int(proc.name)
    raise RuntimeError(f"no rank {rank} of {recipe} found")


def rank_killed(root: Path, steps: int) -> dict:
    root.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_RUN_ID", None)
    body = f"parallel: {{nproc: 2}}\ntrain: {{steps: {steps}, log_every: 1, ckpt_every: 10, dist_timeout_s: 60}}\n"
    runs = {}
    for name in ("uninterrupted", "killed"):
        path = recipe_file(root, name, body)
        spec = RunSpec(name=name, recipe=str(path), result=str(root / f"{name}.json"), ranks_per_node=2,
                       max_restarts=1)
        start = time.monotonic()
        out = Output(subprocess.Popen(local_command(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env))
        kill = None
        if name == "killed":  # halfway between the checkpoints of steps 10 and 20
            checkpoint = root / "out" / name
            while not (any(checkpoint.rglob("step_000010/manifest.json"))
                       and max((s for _, s in out.steps()), default=0) >= KILL_AT_STEP):
                if out.proc.poll() is not None or time.monotonic() - start > 300:
                    raise RuntimeError(f"no step-10 checkpoint and step {KILL_AT_STEP}:\n{out.lines[-20:]}")
                time.sleep(0.01)
            os.kill(rank_pid(path, 1), signal.SIGKILL)
            kill = (time.monotonic(), max((s for _, s in out.steps()), default=0))
        text = out.wait(600)
        runs[name] = {"wall_s": time.monotonic() - start, "result": TrainResult.load(spec.result), "text": text,
                      "kill": kill, "steps": out.steps(), "lines": out.lines}
    killed, straight = runs["killed"], runs["uninterrupted"]
    killed_at, last_step = killed["kill"]
    # the restarted ranks' first step: after their "resumed from" line (a step line of the killed attempt can
    # still arrive just after the kill)
    resumed_at = next((t for t, line in killed["lines"] if t > killed_at and "resumed from" in line), None)
    after = [t for t, _ in killed["steps"] if resumed_at is not None and t > resumed_at]
    return {
        "steps": steps, "checkpoint_step": killed["result"].resumed_from_step, "killed_after_step": last_step,
        "steps_trained_twice": last_step - killed["result"].resumed_from_step,
        "recover_s": after[0] - killed_at if after else None,
        "extra_wall_s": killed["wall_s"] - straight["wall_s"], "uninterrupted_wall_s": straight["wall_s"],
        "final_loss_diff": abs(killed["result"].final_loss - straight["result"].final_loss),
        "restarted": "resumed from" in killed["text"],
    }


def start_mlflow(root: Path, port: int, env: dict[str, str]) -> subprocess.Popen:
    log = (root / f"mlflow-{time.monotonic_ns()}.log").open("w")
    proc = subprocess.Popen([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                             "--default-artifact-root", str(root / "artifacts")],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    wait_healthy(proc, f"http://127.0.0.1:{port}/health", Path(log.name))
    return proc


def logged_steps(url: str, experiment: str) -> list[int]:
    from mlflow import MlflowClient

    client = MlflowClient(url)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], "attributes.run_name = 'train'") if found else []
    return sorted(m.step for r in runs for m in client.get_metric_history(r.info.run_id, "train/loss"))


def rate(points: list[tuple[float, int]]) -> float | None:
    """Steps per second over (time, step) points."""
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def start_prefect(root: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """A Prefect server on loopback (both runs of the outage case meet the same warm one)."""
    port = free_port()
    log = (root / "prefect-server.log").open("w")
    proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env={**env, "PREFECT_HOME": str(root / "prefect")},
                            start_new_session=True)
    wait_healthy(proc, f"http://127.0.0.1:{port}/api/health", Path(log.name))
    return proc, f"http://127.0.0.1:{port}/api"


def wait_healthy(proc: subprocess.Popen, health: str, log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(health, timeout=2):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{proc.args[:3]} did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.3)


def tracking_outage(root: Path, steps: int, away_s: float) -> dict:
    root.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "MLFLOW_RUN_ID")}
    server_env = {**base, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    prefect, api = start_prefect(root, base)
    env = {**base, "MLFLOW_TRACKING_URI": url, "PREFECT_API_URL": api, "OMP_NUM_THREADS": "1"}
    body = (f"parallel: {{nproc: 1}}\ntrain: {{steps: {steps}, log_every: 2, ckpt_every: 0}}\n"
            "tracking: {flush_every_s: 0.5}\n")
    runs = {}
    server = start_mlflow(root, port, server_env)
    try:
        for name in ("server-up", "server-away"):
            path = recipe_file(root, name, body)
            start = time.monotonic()
            out = Output(subprocess.Popen([str(BIN / "omni"), "train", str(path)], cwd=root, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
            away = None
            if name == "server-away":
                while not logged_steps(url, name):
                    if out.proc.poll() is not None or time.monotonic() - start > 300:
                        raise RuntimeError(f"no metric reached the server:\n{out.lines[-20:]}")
                    time.sleep(0.2)
                terminate_group(server, grace_s=0)  # gone at once, as a crashed server is
                left = time.monotonic()
                time.sleep(away_s)
                server = start_mlflow(root, port, server_env)
                away = (left, time.monotonic())
            try:
                out.wait(600)
            finally:
                terminate_group(out.proc, grace_s=10)
            runs[name] = {"wall_s": time.monotonic() - start, "steps": out.steps(), "away": away}
        expected = list(range(2, steps + 1, 2))
        lost = sorted(set(expected) - set(logged_steps(url, "server-away")))
    finally:
        terminate_group(server, grace_s=5)
        terminate_group(prefect, grace_s=5)
    left, back = runs["server-away"]["away"]
    points = runs["server-away"]["steps"]
    during = [p for p in points if left <= p[0] <= back]
    before = [p for p in points if p[0] < left]
    return {
        "steps": steps, "away_s": back - left,
        "steps_trained_while_away": max(s for _, s in during) - max(s for _, s in before) if during and before else 0,
        "steps_per_s_before": rate(before), "steps_per_s_while_away": rate(during),
        "extra_wall_s": runs["server-away"]["wall_s"] - runs["server-up"]["wall_s"],
        "server_up_wall_s": runs["server-up"]["wall_s"], "metrics_lost": len(lost), "lost_steps": lost,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter runs (under 2 minutes)")
    parser.add_argument("--out", default="failure_bench.json")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="omni-failures-") as tmp:
        root = Path(tmp)
        report = {
            "quick": args.quick, "loadavg_before": os.getloadavg(),
            "rank_killed": rank_killed(root / "kill", steps=20 if args.quick else 40),
            "tracking_outage": tracking_outage(root / "outage", steps=60 if args.quick else 600,
                                               away_s=0.5 if args.quick else 15.0),
        }
    report["loadavg_after"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
