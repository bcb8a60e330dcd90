"""Real server processes on loopback for integration tests: started, waited for, and always stopped."""

from __future__ import annotations

import subprocess
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
