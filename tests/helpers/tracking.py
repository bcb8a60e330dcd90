"""A recipe tracking to a given URI under a fresh experiment name: the tracking tests share it (in one process, and
on the session's sqlite store)."""

from __future__ import annotations

import uuid

from omni_core.recipe import Recipe


def make_recipe(uri: str) -> Recipe:
    name = f"t-{uuid.uuid4().hex[:8]}"
    return Recipe.model_validate({"experiment": {"name": name}, "tracking": {"uri": uri, "flush_every_s": 0.1}})
