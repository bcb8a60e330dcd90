"""The process-group supervisor: run a command (torchrun, a server) in its own process group, stream its
output, and never let the group outlive the call. No Prefect: flows wrap it in a task.

A process group, because torchrun's workers (and anything they start) must die with it: on the wall-clock
limit, on flow cancellation, on Ctrl-C or on any error here, the whole group gets SIGTERM, then SIGKILL.

A failed torchrun launch (`launch_torchrun`) ends its LaunchError with the first failing rank's own error,
from the error files torch elastic gives each worker (TORCHELASTIC_ERROR_FILE under torchrun's --log-dir), and
says whether the cause was the infrastructure (a rank killed from outside) rather than the code.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

TAIL_LINES = 40
GRACE_S = 10.0


class LaunchError(RuntimeError):
    """The launched command failed or ran too long; the message carries the end of its output. `infrastructure`:
    a rank was killed from outside (OOM killer, a lost node, preemption) and the others failed only on losing
    it, so launching again (resuming the last checkpoint) may succeed; never set for a rank's own exception or
    for the wall-clock limit."""

    def __init__(self, message: str, *, infrastructure: bool = False) -> None:
        super().__init__(message)
        self.infrastructure = infrastructure


# How a rank's collective fails when a peer vanishes (gloo/NCCL transports, the c10d store)
_LOST_PEER = re.compile(
    r"^(DistBackendError|DistNetworkError|DistStoreError)\b|Connection (reset|closed) by peer"
    r"|Broken pipe|gloo/transport|NCCL (error|communicator)",
    re.I,
)


def with_tail(message: str, tail: Sequence[str]) -> str:
    return f"{message}; last {len(tail)} lines of output:\n" + "\n".join(tail) if tail else message


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    with stream:
        for line in stream:
            lines.put(line.rstrip("\n"))
    lines.put(None)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def terminate_group(proc: subprocess.Popen[str], grace_s: float = GRACE_S) -> None:
    """SIGTERM the process group led by `proc`, SIGKILL whatever is left after `grace_s`."""
    pgid = proc.pid  # start_new_session=True: the child leads its own group
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, or it would keep the group "alive" as a zombie
        if not _group_alive(pgid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()


def run_process_group(
    cmd: Sequence[str],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    on_line: Callable[[str], object] = print,
    grace_s: float = GRACE_S,
    tail_lines: int = TAIL_LINES,
    name: str | None = None,
) -> None:
    """Run `cmd` in a new session, pass each output line (stdout and stderr merged) to `on_line` as it comes,
    and raise LaunchError on a non-zero exit or after `timeout_s`. The group never outlives this call."""
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=dict(env) if env is not None else None,
        start_new_session=True,
    )
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
    reader.start()
    tail: deque[str] = deque(maxlen=tail_lines)
    deadline = time.monotonic() + timeout_s
    exited_at: float | None = None
    name = name or shlex.join(cmd)

    def timed_out() -> LaunchError:
        return LaunchError(with_tail(f"{name} exceeded its {timeout_s:g}s limit and was killed", tail))

    try:
        while True:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                now = time.monotonic()
                if now > deadline:
                    raise timed_out() from None  # the empty queue says nothing more
                if proc.poll() is not None:
                    exited_at = exited_at or now
                    if now - exited_at > 1.0:
                        break  # a leftover grandchild holds the output open; the group is killed below
                continue
            if line is None:
                break
            tail.append(line)
            on_line(line)
        try:  # output closed early does not mean done: the limit still applies
            returncode = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise timed_out() from None
        if returncode != 0:
            raise LaunchError(with_tail(f"{name} exited with code {returncode}", tail))
    finally:
        terminate_group(proc, grace_s)


def torchrun_command(
    recipe_path: str, nproc: int, result_path: str, max_restarts: int = 0, log_dir: str | None = None
) -> list[str]:
    """The train stage's launch on this machine (`targets.local_command`, as Kubernetes and Slurm render it)."""
    from omni_core.runtime.targets import RunSpec, local_command

    return local_command(
        RunSpec(name="local", recipe=recipe_path, result=result_path, ranks_per_node=nproc, max_restarts=max_restarts),
        log_dir,
    )


def launch_torchrun(
    recipe_path: str,
    nproc: int,
    result_path: str,
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    on_line: Callable[[str], object] = print,
    max_restarts: int = 0,
) -> None:
    """`torchrun_command` under `run_process_group`; when the ranks fail, the LaunchError ends with the first
    failing rank's own error (`RankFailures`), not with torchrun's summary of exit codes."""
    with tempfile.TemporaryDirectory(prefix="omni-torchrun-") as log_dir:
        try:
            run_process_group(
                torchrun_command(recipe_path, nproc, result_path, max_restarts, log_dir),
                timeout_s=timeout_s,
                env=env,
                on_line=on_line,
                name="torchrun",
            )
        except LaunchError as error:
            if str(error).startswith("torchrun exceeded"):
                raise
            failed = RankFailures(Path(log_dir))
            explained = "\n\n".join(filter(None, [str(error), failed.silent_note(), failed.first_error()]))
            raise LaunchError(explained, infrastructure=failed.infrastructure) from None


class RankFailures:
    """What the last attempt's ranks left under torchrun's --log-dir (<run>/attempt_<n>/<local rank>/): the
    error file `launch.main` records a rank's exception in, or nothing, for a rank that died without one."""

    def __init__(self, log_dir: Path) -> None:
        attempts = sorted(log_dir.glob("*/attempt_*"), key=lambda path: int(path.name.removeprefix("attempt_")))
        ranks = sorted(p for p in attempts[-1].iterdir() if p.is_dir()) if attempts else []
        self.errors: list[tuple[int, str, str]] = []  # (written at, local rank, "Type: message")
        self.silent: list[str] = []  # local ranks that left no error
        for rank in ranks:
            try:
                path = rank / "error.json"
                self.errors.append(
                    (path.stat().st_mtime_ns, rank.name, json.loads(path.read_text())["message"]["message"])
                )
            except (OSError, ValueError, KeyError, TypeError):  # none, or half-written
                self.silent.append(rank.name)

    def first_error(self) -> str | None:
        """`rank R failed first: Type: message`: the earliest file, since ranks that fail because a peer died
        write theirs after it."""
        if not self.errors:
            return None
        _, rank, message = min(self.errors)
        return f"rank {rank} failed first: {message}"

    def silent_note(self) -> str | None:
        if not self.silent:
            return None
        return f"rank {', '.join(self.silent)} left no error of its own (killed by a signal, or torchrun stopped it)"

    @property
    def infrastructure(self) -> bool:
        """A rank died without an error of its own, and no rank failed first for a reason other than losing a
        peer: the cause came from outside the code. (A rank that raises gets its peers stopped by torchrun: they
        are silent too, but the first error is then the raising rank's own.)"""
        if not self.silent:
            return False
        return not self.errors or bool(_LOST_PEER.search(min(self.errors)[2]))
