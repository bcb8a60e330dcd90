"""MLflow tracking for omni, and the only place that talks to MLflow (imported lazily, so importing this
package stays cheap): tracking URI and health check, trackers (async batched metrics on rank 0, no-op
elsewhere), and the parent/stage run tree of a flow run."""

from omni_core.tracking.models import log_checkpoint, register_checkpoint
from omni_core.tracking.pending import pending, replay_when_reachable, settle
from omni_core.tracking.runs import children_of, current_parent_run_id, git_sha, log_to_run, parent_run, stage_run
from omni_core.tracking.store import (
    DEFAULT_TRACKING_URI,
    TrackingError,
    artifact_location,
    check_tracking_uri,
    disable_telemetry,
    resolve_tracking_uri,
)
from omni_core.tracking.tracker import (
    SPOOL_FILE,
    MlflowTracker,
    NullTracker,
    Tracker,
    replay_spool,
    sanitize_metric_name,
    system_metrics,
    tracker_for_rank,
)
from omni_core.tracking.ui import runs_page_url

__all__ = [
    "DEFAULT_TRACKING_URI",
    "SPOOL_FILE",
    "MlflowTracker",
    "NullTracker",
    "Tracker",
    "TrackingError",
    "artifact_location",
    "check_tracking_uri",
    "children_of",
    "current_parent_run_id",
    "disable_telemetry",
    "git_sha",
    "log_checkpoint",
    "log_to_run",
    "parent_run",
    "pending",
    "register_checkpoint",
    "replay_spool",
    "replay_when_reachable",
    "resolve_tracking_uri",
    "runs_page_url",
    "sanitize_metric_name",
    "settle",
    "stage_run",
    "system_metrics",
    "tracker_for_rank",
]
