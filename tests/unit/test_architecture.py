"""The layering of docs/architecture.md, enforced: `lint-imports` checks the contracts in pyproject.toml, and
a wrong arrow added to a copy of the tree breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the tree's packages, not the installed ones
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=120)


def copy_tree(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__")
    for package in ("omni_core", "flows"):
        shutil.copytree(ROOT / package, dest / package, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_the_code_keeps_its_layers():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(("module", "line", "broken"), [
    ("omni_core/models/llm.py", "from omni_core.runtime.step import train_step",
     "omni_core.models is not allowed to import omni_core.runtime"),
    ("omni_core/estimator/cost.py", "from omni_core.measure.validate import validate",
     "omni_core.estimator is not allowed to import omni_core.measure"),
    ("omni_core/data/loader.py", "import prefect", "omni_core never imports Prefect or the flows"),
    ("omni_core/runtime/trainer.py", "from flows import stage_dir", "omni_core never imports Prefect or the flows"),
])
def test_a_wrong_import_breaks_a_contract(tmp_path, module, line, broken):
    tree = copy_tree(tmp_path)
    with open(tree / module, "a") as source:
        source.write(f"\n\ndef _wrong():\n    {line}\n")  # even a lazy import inside a function counts
    result = lint_imports(tree)
    assert result.returncode != 0 and broken in result.stdout, result.stdout + result.stderr


def test_the_cost_model_imports_without_torch():
    modules = ["cost", "terms", "communication", "memory", "stage", "pipeline", "encoders", "search", "layouts",
               "oracle", "calibration", "workloads", "transformer_layers", "lm_workloads", "cnn_workloads",
               "omni_workloads", "trace_workloads", "paper_workloads", "recipe_cells"]
    modules += ["accuracy", "published", "arena"]  # the estimator's checks against published measurements
    code = "; ".join(f"import omni_core.estimator.{m}" for m in modules)
    result = subprocess.run([sys.executable, "-c", f"{code}; import sys; print('torch' in sys.modules)"],
                            capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stdout + result.stderr
