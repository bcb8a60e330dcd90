"""`make test` runs the tiers as concurrent pytest streams (tests/run-streams): every tier is in exactly one
stream, and the runner fails when any stream fails or collects nothing."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TIERS

REPO = Path(__file__).resolve().parents[2]
RUN_STREAMS = REPO / "tests" / "run-streams"


def test_the_makefile_streams_hold_every_tier_once():
    line = re.search(r"^TEST_STREAMS := (.+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    named = [word for stream in shlex.split(line) for word in stream.split() if word not in ("or", "and", "not")]
    assert sorted(named) == sorted(TIERS)


def run_streams(tmp_path: Path, *streams: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(RUN_STREAMS), *streams, "--", "-p", "no:cacheprovider", "-W", "ignore"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def two_tiers(tmp_path: Path) -> Path:
    (tmp_path / "test_tiers.py").write_text(
        "import pytest\n"
        "@pytest.mark.fast\ndef test_passes(): pass\n"
        "@pytest.mark.slow\ndef test_fails(): assert False, 'the slow tier fails'\n"
        "@pytest.mark.other\ndef test_also_passes(): pass\n"
    )
    return tmp_path


def test_a_failing_stream_fails_the_run_and_its_log_is_shown(two_tiers: Path):
    result = run_streams(two_tiers, "fast", "slow")
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'stream [0] -m "fast": exit 0' in result.stdout
    assert 'stream [1] -m "slow": exit 1' in result.stdout
    assert "the slow tier fails" in result.stdout


def test_a_stream_that_collects_nothing_fails_the_run(two_tiers: Path):
    result = run_streams(two_tiers, "fast", "missing")
    assert result.returncode == 1
    assert 'stream [1] -m "missing": exit 5' in result.stdout


def test_streams_that_all_pass_pass(two_tiers: Path):
    result = run_streams(two_tiers, "fast", "other")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("1 passed") == 2
