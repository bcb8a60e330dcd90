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
