"""Where MLflow data goes: tracking URI resolution, a fast reachability check, and the MLflow client.

Every MLflow import in omni goes through `mlflow_client`, so `omni --help` and recipe checks never pay
for importing MLflow, and telemetry is off before MLflow is loaded.
"""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from omni_core.recipe import Recipe

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"  # MLflow 3's own default, so a plain `mlflow ui` sees our runs
ARTIFACTS_DIRNAME = "mlartifacts"  # what `mlflow ui` / `mlflow server` serve artifacts from by default
HEALTH_TIMEOUT_S = 3.0
# The stores MLflow tracks to: a server, a database through SQLAlchemy (`postgresql+psycopg2`: the part before
# `+`), a folder, Databricks; anything else (ftp://, s3://) fails inside MLflow at the first logged value.
TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "file", "databricks")

TELEMETRY_OFF = {
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


class TrackingError(RuntimeError):
    """A tracking problem the user can fix (server down, bad URI, lost metrics); str() is the whole message."""


def disable_telemetry() -> None:
    """No phoning home from MLflow or Prefect unless the user asked for it. Call before importing them."""
    for key, value in TELEMETRY_OFF.items():
        os.environ.setdefault(key, value)


def resolve_tracking_uri(recipe: Recipe | None = None) -> str:
    """recipe.tracking.uri, else $MLFLOW_TRACKING_URI, else ./mlflow.db, with local paths made absolute
    so the torchrun ranks and a later `mlflow ui` hit the same database whatever their working directory."""
    uri = (recipe.tracking.uri if recipe is not None else None) or os.environ.get("MLFLOW_TRACKING_URI")
    uri = uri or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////") and uri != "sqlite:///:memory:":
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///") :])
    if not urlsplit(uri).scheme:  # a bare path: MLflow's file store
        return os.path.abspath(uri)
    return uri


def _sqlite_path(uri: str) -> Path | None:
    if uri.startswith("sqlite:///") and uri != "sqlite:///:memory:":
        return Path(uri[len("sqlite:///") :].split("?", 1)[0])
    return None


def check_tracking_uri(uri: str, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Fail in seconds with one clear message instead of MLflow's minutes of retries and a traceback."""
    scheme = urlsplit(uri).scheme
    if scheme and scheme.split("+")[0] not in TRACKING_SCHEMES:
        raise TrackingError(
            f"MLflow tracking URI {uri}: MLflow cannot track to {scheme}:// (it tracks to "
            f"{', '.join(s + '://' for s in TRACKING_SCHEMES)} or a local folder)."
        )
    if scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
                return
        except urllib.error.HTTPError as e:
            if e.code < 500:  # it answers; auth or routing problems are MLflow's to report
                return
            reason = f"HTTP {e.code} from /health"
        except (TimeoutError, urllib.error.URLError, OSError) as e:
            reason = str(getattr(e, "reason", e)) or type(e).__name__
        raise TrackingError(
            f"MLflow tracking server {uri} is not reachable ({reason}). Start it, fix MLFLOW_TRACKING_URI "
            f"(or tracking.uri in the recipe), or unset it to track to a local {DEFAULT_TRACKING_URI}."
        )
    db = _sqlite_path(uri)
    if db is not None and not db.parent.is_dir():
        raise TrackingError(f"MLflow tracking URI {uri}: directory {db.parent} does not exist.")


def artifact_location(uri: str, experiment: str) -> str | None:
    """For a local sqlite store: <db dir>/mlartifacts/<experiment>, beside the database, where `mlflow ui`
    keeps artifacts too (MLflow's in-process default would be ./mlruns of whatever directory created the
    experiment). None elsewhere, so a server's own artifact root (e.g. S3) applies."""
    db = _sqlite_path(uri)
    if db is None:
        return None
    return str(db.parent / ARTIFACTS_DIRNAME / re.sub(r"[^A-Za-z0-9._-]+", "_", experiment))


def mlflow_client(uri: str) -> MlflowClient:
    disable_telemetry()
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)
