"""Recipe overrides tracking to a given URI under a fresh experiment name: the tracking tests share them (in one
process, and on the session's sqlite store)."""

from __future__ import annotations

import uuid


def tracking_to(uri: str) -> dict[str, object]:
    """Overrides for tests.helpers.recipes.build_recipe: a new experiment on `uri`, metrics flushed every 0.1 s."""
    return {"experiment.name": f"t-{uuid.uuid4().hex[:8]}", "tracking.uri": uri, "tracking.flush_every_s": 0.1}
