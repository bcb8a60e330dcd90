"""Training as a Slurm batch job (`launch.target: slurm`): the run spec's `targets.slurm_script`, submitted
with `sbatch`, followed until it ends with its output streamed as a local launch streams torchrun's, and never
left behind: the wall-clock limit, a cancelled flow run, Ctrl-C or any error while following it `scancel`s it.

The job inherits the submitting process's environment (sbatch's default), so the tracking run's id and URI
reach the ranks without being written into the script. The cluster's nodes must share this filesystem: the
recipe, the result file, the checkpoints and the job's output file are paths here.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

from omni_core.runtime.supervisor import TAIL_LINES, LaunchError, with_tail
from omni_core.runtime.targets import RunSpec, slurm_script

JOB_ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
}
FROM_OUTSIDE = {"NODE_FAIL", "PREEMPTED", "BOOT_FAIL"}  # the cluster's doing: launching again may succeed
CANCEL_WAIT_S = 60.0  # scancel's SIGTERM, then Slurm's KillWait (30 s by default) before SIGKILL


def run_slurm_job(
    spec: RunSpec,
    folder: Path,
    *,
    timeout_s: float,
    env: Mapping[str, str],
    on_line: Callable[[str], object] = print,
    poll_s: float = 2.0,
) -> None:
    """Submit `spec` as a batch job (its script and output in `folder`), stream its output until it ends, and
    raise LaunchError unless it COMPLETED (`infrastructure` when the cluster lost or preempted it)."""
    job, output = submit(spec, folder, env)
    on_line(f"slurm job {job} submitted: {spec.nodes} node(s) x {spec.ranks_per_node} ranks, output in {output}")
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    deadline, read, state = time.monotonic() + timeout_s, 0, ("PENDING", "")
    try:
        while state[0] not in JOB_ENDED:
            if time.monotonic() > deadline:
                raise LaunchError(
                    with_tail(f"slurm job {job} exceeded its {timeout_s:g}s limit and was cancelled", tail)
                )
            time.sleep(poll_s)
            state = job_state(job, env)
            read = _stream(output, read, tail, on_line)
    finally:
        if state[0] not in JOB_ENDED:
            cancel(job, env)
    if state[0] != "COMPLETED":
        raise LaunchError(
            with_tail(f"slurm job {job} ended {state[0]} (exit code {state[1]})", tail),
            infrastructure=state[0] in FROM_OUTSIDE,
        )


def submit(spec: RunSpec, folder: Path, env: Mapping[str, str]) -> tuple[str, Path]:
    """sbatch the spec's script (torchrun from this interpreter, on the shared filesystem): (job id, output)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / f"{spec.name}.sbatch"
    script.write_text(slurm_script(spec, (sys.executable, "-m", "torch.distributed.run")))
    job = _slurm(["sbatch", "--parsable", f"--output={folder / spec.name}-%j.out", str(script)], env)
    job = job.split(";")[0].strip()  # "<id>[;<cluster>]"
    return job, folder / f"{spec.name}-{job}.out"


def job_state(job: str, env: Mapping[str, str]) -> tuple[str, str]:
    """(JobState, ExitCode) from `scontrol show job`: Slurm keeps an ended job there for MinJobAge (300 s by
    default), and needs no accounting database."""
    fields = dict(
        token.split("=", 1) for token in _slurm(["scontrol", "show", "job", "-o", job], env).split() if "=" in token
    )
    return fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", "")


def unknown_nodes(names: list[str], env: Mapping[str, str]) -> list[str]:
    """Those of `names` the cluster has no node of (`sinfo`'s node list), which sbatch --nodelist would refuse."""
    known = set(_slurm(["sinfo", "-h", "-N", "-o", "%N"], env).split())
    return [name for name in names if name not in known]


def cancel(job: str, env: Mapping[str, str]) -> None:
    """scancel the job and wait until Slurm has ended it (its processes are gone)."""
    _slurm(["scancel", job], env)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while job_state(job, env)[0] not in JOB_ENDED and time.monotonic() < deadline:
        time.sleep(0.5)


def _slurm(cmd: list[str], env: Mapping[str, str]) -> str:
    try:
        done = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        raise LaunchError(f"{cmd[0]} not found: launch.target=slurm needs Slurm's commands on PATH") from None
    if done.returncode != 0:
        raise LaunchError(f"{cmd[0]} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _stream(output: Path, read: int, tail: deque[str], on_line: Callable[[str], object]) -> int:
    """Pass the output's complete lines after byte `read` to `on_line`; returns how far it has read."""
    try:
        with output.open("rb") as f:
            f.seek(read)
            chunk = f.read()
    except FileNotFoundError:  # the job has not started
        return read
    complete = chunk[: chunk.rfind(b"\n") + 1]
    for line in complete.decode(errors="replace").splitlines():
        tail.append(line)
        on_line(line)
    return read + len(complete)
