"""Shared test set-up: the tiers, telemetry off, a throw-away PREFECT_HOME and OMNI_HOME for the session (Prefect's
result storage outlives prefect_test_harness otherwise), a session sqlite MLflow store, and the Prefect test harness.

A test file's folder is its tier, and the tier its marker (`-m unit`, `-m "not integration"`):
  tests/unit         pure CPU, no ranks, flows or servers: seconds (`make test-fast`)
  tests/ranks        forks gloo ranks (omni_core.runtime.ranks.run_ranks) or launches torchrun
  tests/flows        Prefect flows (prefect_harness) and MLflow on sqlite (mlflow_store, mlflow_uri)
  tests/integration  real server processes: moto's S3 (s3_server, s3_endpoint), `mlflow server`, `prefect server`
Helpers that tests of several files share live in tests/helpers/ (imported as tests.helpers.<name>).

PREFECT_HOME and the telemetry switches are set at import, before any test module imports Prefect or MLflow.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_core.tracking import disable_telemetry

pytest.register_assert_rewrite("tests.helpers")  # their asserts explain failures as a test module's do
TESTS_DIR = Path(__file__).resolve().parent
TIERS = ("unit", "ranks", "flows", "integration")

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="omni-tests-"))
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
os.environ["OMNI_HOME"] = str(_SESSION_DIR / "omni")  # pending tracking (omni_core.tracking.pending), not ~/.omni
disable_telemetry()
for _var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "PREFECT_API_URL"):  # never a developer's real servers
    os.environ.pop(_var, None)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


def tier_of(path: Path) -> str | None:
    """The tier of a test file: the first folder under tests/, when it is one of TIERS."""
    try:
        parts = path.resolve().relative_to(TESTS_DIR).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its file's tier; a test file outside the tier folders fails the collection."""
    stray = set()
    for item in items:
        tier = tier_of(item.path)
        if tier is None:
            stray.add(item.nodeid.split("::", 1)[0])
        else:
            item.add_marker(tier)
    if stray:
        raise pytest.UsageError(
            "test files outside the tier folders tests/{" + ",".join(TIERS) + "}/ (the folder gives a test its "
            "marker; see tests/conftest.py):\n  " + "\n  ".join(sorted(stray))
        )


@pytest.fixture(scope="session")
def mlflow_store() -> str:
    """A sqlite MLflow store shared by the session (creating one costs seconds); tests use their own
    experiments or runs in it."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{_SESSION_DIR / 'mlflow' / 'mlflow.db'}"
    (_SESSION_DIR / "mlflow").mkdir()
    MlflowClient(uri).search_experiments()  # creates the schema once
    return uri


@pytest.fixture
def mlflow_uri(mlflow_store: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The session store, also as $MLFLOW_TRACKING_URI for code that resolves the URI itself."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store)
    return mlflow_store


HARNESS_STARTS = 3


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """A temporary Prefect API and database for the flow tests of this session. Prefect's start-up loop waits
    for a refused connection but not for a `/health` answer slower than httpx's 5 s read timeout, nor for a
    connection the starting server resets, which a 2-core machine busy with the other test stream can give:
    such a start is stopped and tried again."""
    import httpx
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.testing.utilities import prefect_test_harness

    for start in range(1, HARNESS_STARTS + 1):
        harness = prefect_test_harness(server_startup_timeout=120)
        try:
            harness.__enter__()
        except (httpx.ReadTimeout, httpx.ReadError):
            slow = SubprocessASGIServer._instances.get(None)
            if slow is not None:
                slow.stop()
            if start == HARNESS_STARTS:
                raise
            continue
        try:
            yield
        finally:
            harness.__exit__(None, None, None)
        return


@pytest.fixture(scope="session")
def prefect_api_url(prefect_harness: None) -> str:
    """The harness's Prefect API (a server process on loopback), for `omni` processes a test starts: without
    one, each would start a temporary server of its own (about 15 s here)."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


@pytest.fixture
def uncalibrated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimator's catalogue numbers for `cpu`, not a micro-profile someone stored on this machine."""
    monkeypatch.setenv("OMNI_CALIBRATION_DIR", str(tmp_path / "no-calibration"))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's standalone S3 server on a free loopback port: a real HTTP endpoint, as MinIO would be."""
    import sys

    from omni_core.runtime.ranks import free_port
    from tests.servers import server_process

    url = f"http://127.0.0.1:{free_port()}"
    port = url.rsplit(":", 1)[1]
    moto = Path(sys.executable).parent / "moto_server"
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with server_process([str(moto), "-H", "127.0.0.1", "-p", port], f"{url}/moto-api/", log=log):
        yield url


@pytest.fixture
def s3_endpoint(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """boto3 clients made in the test (and the code under test) reach the loopback server."""
    for key, value in {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "test",
                       "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    return s3_server
