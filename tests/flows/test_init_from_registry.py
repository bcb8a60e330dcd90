"""`model.init_from: models:/NAME@ALIAS`: a checkpoint registered in the session's sqlite MLflow store (as the
train stage registers its final one) is downloaded once and its weights start a new run; an unknown alias is
named."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from omni_core.runtime.checkpoint import latest_checkpoint
from omni_core.runtime.ckpt_store import MANIFEST, LocalStore
from omni_core.runtime.trainer import resume, set_up, train
from omni_core.tracking import MlflowTracker
from omni_core.tracking.models import log_checkpoint, register_checkpoint
from tests.helpers.recipes import build_recipe
from tests.helpers.runtime import CPU


def test_a_registered_checkpoint_starts_a_run(mlflow_store: str, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_store)
    experiment = client.create_experiment(f"t-{uuid.uuid4().hex[:8]}", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(experiment).info.run_id
    first = build_recipe(tmp_path, {"train.steps": 2, "train.ckpt_dir": str(tmp_path / "first")})
    train(first, CPU, log=lambda _: None)
    location = latest_checkpoint(LocalStore(tmp_path / "first"))
    assert location is not None
    tracker = MlflowTracker(run_id, mlflow_store)
    name = f"m-{uuid.uuid4().hex[:8]}"
    register_checkpoint(tracker, name=name, source=log_checkpoint(tracker, location, Path(location) / MANIFEST),
                        alias="current")
    tracker.close()

    second = build_recipe(tmp_path, {"experiment.name": "second", "tracking.uri": mlflow_store,
                                     "model.init_from": f"models:/{name}@current", "experiment.seed": 9})
    run = set_up(second, CPU, lambda _: None)
    assert resume(run)[0] == 0
    dcp_to_torch_save(location, tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)["model"]
    for key, value in run.replica.parts[0].state_dict().items():
        assert torch.equal(value, saved[key]), key

    unknown = build_recipe(tmp_path, {"experiment.name": "third", "tracking.uri": mlflow_store,
                                      "model.init_from": f"models:/{name}@nope"})
    with pytest.raises(ValueError, match=f"models:/{name}@nope: not in the registry at {mlflow_store}"):
        resume(set_up(unknown, CPU, lambda _: None))
