"""Real server processes on loopback for integration tests: started, waited for, and always stopped."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from omni_core.runtime.supervisor import terminate_group


@contextmanager
def server_process(
    cmd: Sequence[str], health_url: str, *, log: Path, env: dict[str, str] | None = None, timeout_s: float = 90.0
) -> Iterator[subprocess.Popen]:
    """Run `cmd` in its own process group until `health_url` answers 2xx; kill the group on exit."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(health_url, timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{cmd[0]} not healthy after {timeout_s}s:\n{log.read_text()[-3000:]}")
                time.sleep(0.3)
        yield proc
    finally:
        terminate_group(proc, grace_s=15)


def postgres_bin(name: str) -> str:
    """A PostgreSQL program: on PATH, or where the Debian package puts it (`.ci/run` installs it where absent)."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        raise RuntimeError(f"PostgreSQL's {name} not found: `apt-get install -y postgresql` (as .ci/run does)")
    return found


@contextmanager
def postgres_server(port: int, *, database: str = "mlflow") -> Iterator[str]:
    """A throwaway PostgreSQL cluster on 127.0.0.1:`port` (trust auth, loopback only); yields its SQLAlchemy URI.
    PostgreSQL refuses to run as root, so under root the cluster belongs to the package's `postgres` user."""
    data = Path(tempfile.mkdtemp(prefix="omni-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(data, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]

    def run(*cmd: str) -> None:
        subprocess.run([*as_user, *cmd], check=True, capture_output=True, text=True, timeout=120)

    try:
        run(postgres_bin("initdb"), "-D", str(data / "db"), "-U", "omni", "-A", "trust", "--no-sync")
        run(postgres_bin("pg_ctl"), "-D", str(data / "db"), "-l", str(data / "server.log"), "-w", "-t", "60",
            "-o", f"-h 127.0.0.1 -p {port} -k {data}", "start")
        try:
            run(postgres_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "omni", database)
            yield f"postgresql://omni@127.0.0.1:{port}/{database}"
        finally:
            run(postgres_bin("pg_ctl"), "-D", str(data / "db"), "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(data, ignore_errors=True)


SLURM_DAEMONS = ("munged", "slurmctld", "slurmd")


def slurm_bin(name: str) -> str:
    """A Slurm or MUNGE program (Debian: slurmctld, slurmd, slurm-client, munge; `.ci/run` installs them)."""
    found = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)),
                                       None)
    if found is None:
        raise RuntimeError(f"{name} not found: `apt-get install -y slurmctld slurmd slurm-client munge` (as .ci/run "
                           "does)")
    return found


@contextmanager
def slurm_cluster(nodes: int = 1) -> Iterator[dict[str, str]]:
    """A Slurm cluster on loopback: its own MUNGE daemon (socket in a temporary folder, the package's key),
    slurmctld and one slurmd per node on free ports, as the current user, with no cgroups (process tracking by
    parentage). One node is this host by name, with its CPUs; more are nodes n1..nk of one CPU each, every one a
    slurmd of its own on this host (its own port and spool) at 127.0.0.1. Yields the environment its clients
    need (SLURM_CONF) once every node is idle."""
    import getpass
    import socket

    from omni_core.runtime.ranks import free_port

    root = Path(tempfile.mkdtemp(prefix="omni-slurm-"))
    user, host = getpass.getuser(), socket.gethostname().split(".")[0]
    names = [host] if nodes == 1 else [f"n{i + 1}" for i in range(nodes)]
    for folder in ("state", "munge", *(f"spool-{name}" for name in names)):
        (root / folder).mkdir()
    if nodes == 1:
        node_lines = [f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=16000 State=UNKNOWN"]
    else:
        node_lines = [f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=1 "
                      "RealMemory=8000 State=UNKNOWN" for name in names]
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=omni-test", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmUser={user}", f"SlurmdUser={user}",
        "AuthType=auth/munge", f"AuthInfo=socket={root}/munge/munge.socket", f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool-%n", f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid", f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "MpiDefault=none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2",
        *node_lines, f"PartitionName=omni Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP", ""]))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    munge = [slurm_bin("munged"), "--foreground", "--force", f"--socket={root}/munge/munge.socket",
             f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/munge/munged.log",
             f"--seed-file={root}/munge/munged.seed"]
    procs = []
    try:
        for cmd in (munge, [slurm_bin("slurmctld"), "-D", "-f", str(conf), "-L", str(root / "slurmctld.log")],
                    *([slurm_bin("slurmd"), "-D", "-N", name, "-f", str(conf), "-L", str(root / f"slurmd-{name}.log")]
                      for name in names)):
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
            time.sleep(0.5)
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run([slurm_bin("sinfo"), "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            if state.stdout.strip() == "idle":
                break
            dead = [p.args[0] for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(p.read_text()[-1500:] for p in root.glob("*.log"))
                raise RuntimeError(f"slurm not ready (exited: {dead}; sinfo: {state.stdout or state.stderr}):\n{logs}")
            time.sleep(0.5)
        yield {"SLURM_CONF": str(conf)}
    finally:
        for proc in reversed(procs):
            terminate_group(proc, grace_s=10)
        shutil.rmtree(root, ignore_errors=True)
