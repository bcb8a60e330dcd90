"""The tests' one recipe builder: a tiny base recipe, changed per test by dotted overrides.

`build_recipe(tmp_path, {"train.steps": 4, "data.synthetic.num_samples": 40})` applies the overrides with
`omni_core.recipe.override_recipe`, the machinery of `omni ... --set key=value`: a mistyped key or a wrong type
fails with the loader's own message (a RecipeError naming the `--set`), and a test's recipe is validated exactly
as a user's is. `write_recipe` writes one as YAML for the tests that start `omni` on a file.

Tests of the YAML loader itself (line numbers, `extends:`, the shipped recipes) keep their YAML literal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omni_core.recipe import Recipe, dump_recipe, override_recipe

# Fast on one CPU core: 80 samples of 256-token sequences, six steps on the debug flavor, two held-out batches.
BASE: dict[str, Any] = {
    "experiment": {"name": "tiny", "seed": 3},
    "data": {"synthetic": {"num_samples": 80}, "seq_len": 256},
    "train": {"steps": 6, "warmup_steps": 2, "log_every": 1, "ckpt_every": 0},
    "eval": {"max_batches": 2},
}

Overrides = Mapping[str, object]


def build_recipe(root: Path | str | None = None, overrides: Overrides | None = None) -> Recipe:
    """BASE, writing under `root` (its `experiment.output_dir`; None keeps the default, `runs` in the working
    directory), with `overrides` (dotted key -> value) applied in order as `--set key=value` would be."""
    dotted: dict[str, object] = {} if root is None else {"experiment.output_dir": str(root)}
    dotted.update(overrides or {})
    return override_recipe(Recipe.model_validate(BASE), [f"{key}={_as_yaml(value)}" for key, value in dotted.items()])


def write_recipe(path: Path, overrides: Overrides | None = None, root: Path | str | None = None) -> Path:
    """`build_recipe(root, overrides)` written to `path` as the resolved YAML `omni recipe show` prints."""
    path.write_text(dump_recipe(build_recipe(root, overrides)))
    return path


def _as_yaml(value: object) -> str:
    """A value as `--set` reads it: JSON is YAML's flow form; paths are written as strings."""
    return json.dumps(value, default=str)
