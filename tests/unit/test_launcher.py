"""omni_core.runtime.supervisor: the process-group runner behind the torchrun task, driven with plain commands."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from omni_core.runtime.supervisor import LaunchError, RankFailures, run_process_group, torchrun_command


def alive(pid: int) -> bool:
    """Running, or stopped; a zombie (killed, not yet reaped by init) counts as dead."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_dead(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_output_is_streamed_as_it_comes_stdout_and_stderr():
    seen: list[tuple[float, str]] = []
    run_process_group(
        ["sh", "-c", "echo first; sleep 1; echo second >&2"],
        timeout_s=30,
        on_line=lambda line: seen.append((time.monotonic(), line)),
    )
    assert [line for _, line in seen] == ["first", "second"]
    assert seen[1][0] - seen[0][0] > 0.7  # "first" arrived while the command was still running


def test_non_zero_exit_raises_with_the_last_lines():
    script = "for i in $(seq 1 100); do echo line $i; done; echo boom >&2; exit 3"
    with pytest.raises(LaunchError, match="exited with code 3") as info:
        run_process_group(["sh", "-c", script], timeout_s=30, on_line=lambda line: None, name="job")
    message = str(info.value)
    assert message.startswith("job exited with code 3; last 40 lines")
    assert "line 100\nboom" in message and "line 62\n" in message and "line 61\n" not in message


@pytest.fixture
def group_signals(monkeypatch) -> list[tuple[int, float]]:
    """The signals the supervisor sends its process groups (liveness probes, signal 0, left out), each with the
    time.monotonic() it keeps its deadlines by; each is still sent."""
    sent: list[tuple[int, float]] = []
    killpg = os.killpg

    def recording(pgid: int, sig: int) -> None:
        if sig:
            sent.append((sig, time.monotonic()))
        killpg(pgid, sig)

    monkeypatch.setattr(os, "killpg", recording)
    return sent


@pytest.mark.timeout(30)  # a hang guard: the commands sleep for 60 s unless the limit kills them
def test_timeout_kills_the_whole_group_including_grandchildren():
    lines: list[str] = []
    with pytest.raises(LaunchError, match="exceeded its 1s limit"):
        run_process_group(["sh", "-c", "sleep 60 & echo $!; sleep 60"], timeout_s=1, on_line=lines.append)
    assert wait_dead(int(lines[0]))


@pytest.mark.timeout(30)
def test_processes_ignoring_sigterm_are_killed_after_the_grace_period(group_signals):
    lines: list[str] = []
    script = "trap '' TERM; sleep 60 & echo $!; wait"  # the ignored SIGTERM is inherited by sleep
    with pytest.raises(LaunchError, match="limit"):
        run_process_group(["sh", "-c", script], timeout_s=0.5, grace_s=1, on_line=lines.append)
    assert wait_dead(int(lines[0]))
    (term, termed_at), (kill, killed_at) = group_signals
    assert (term, kill) == (signal.SIGTERM, signal.SIGKILL) and killed_at - termed_at >= 1  # after the grace


def test_any_exception_in_the_caller_kills_the_group():
    child: list[int] = []

    def interrupt(line: str) -> None:
        child.append(int(line))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_process_group(["sh", "-c", "sleep 60 & echo $!; wait"], timeout_s=60, on_line=interrupt)
    assert wait_dead(child[0])


def test_success_returns_and_leaves_no_process_behind():
    lines: list[str] = []
    run_process_group([sys.executable, "-c", "import os; print(os.getpid())"], timeout_s=30, on_line=lines.append)
    assert wait_dead(int(lines[0]), within_s=1)


def test_torchrun_command():
    cmd = torchrun_command("r.yaml", 2, "out.json")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:] == [
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "-m", "omni_core.runtime.launch",
        "--recipe", "r.yaml", "--result", "out.json",
    ]  # fmt: skip


def test_torchrun_command_keeps_error_files_in_the_log_dir():
    cmd = torchrun_command("r.yaml", 2, "out.json", log_dir="/tmp/logs")
    assert cmd[3:6] == ["--log-dir", "/tmp/logs", "--standalone"]


def record_error(monkeypatch, path: Path, error: Exception, written_ns: int) -> None:
    """What a worker's `launch.main` leaves for its rank: torch elastic's error file, written at `written_ns`."""
    path.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise error
    except type(error) as raised:
        ErrorHandler().record_exception(raised)
    os.utime(path, ns=(written_ns, written_ns))


def test_the_first_failing_rank_of_the_last_attempt_is_named(tmp_path, monkeypatch):
    run = tmp_path / "none_abc"
    t = time.time_ns()
    record_error(monkeypatch, run / "attempt_0" / "0" / "error.json", ValueError("first attempt"), t)
    record_error(monkeypatch, run / "attempt_1" / "0" / "error.json", RuntimeError("peer hung up"), t + 3_000)
    record_error(monkeypatch, run / "attempt_1" / "1" / "error.json", ValueError("bad batch"), t + 2_000)
    (run / "attempt_1" / "2").mkdir()
    (run / "attempt_1" / "2" / "error.json").write_text("")  # a rank killed while writing
    failures = RankFailures(tmp_path)
    assert failures.first_error() == "rank 1 failed first: ValueError: bad batch"
    assert failures.silent == ["2"] and not failures.infrastructure  # rank 1's own error came first


def test_no_error_file_names_no_rank(tmp_path):
    (tmp_path / "none_abc" / "attempt_0" / "0").mkdir(parents=True)
    assert RankFailures(tmp_path).first_error() is None
    assert RankFailures(tmp_path).infrastructure  # killed without a word: from outside
    assert RankFailures(tmp_path / "absent").first_error() is None


def test_a_rank_killed_from_outside_is_an_infrastructure_failure(tmp_path, monkeypatch):
    """What `kill -9` of rank 1 leaves (measured with gloo): rank 0's collective fails on the lost peer, rank 1
    writes nothing. A rank's own exception with a silent peer (stopped by torchrun) is the code's failure."""
    run = tmp_path / "none_abc" / "attempt_0"
    lost = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:36764: Connection reset by peer")
    record_error(monkeypatch, run / "0" / "error.json", lost, time.time_ns())
    (run / "1").mkdir()
    assert RankFailures(tmp_path).infrastructure
    (run / "0" / "error.json").unlink()
    (run / "0").rmdir()
    record_error(monkeypatch, run / "0" / "error.json", KeyError("modality"), time.time_ns())
    assert not RankFailures(tmp_path).infrastructure
