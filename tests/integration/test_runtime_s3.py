"""Runtime checkpoints on S3 (moto's server on loopback): saved there, resumed from there on a fresh machine, and
an incomplete save refused."""

from __future__ import annotations

import pytest

from omni_core.runtime.ckpt_store import CheckpointError, checkpoint_store
from omni_core.runtime.evaluate import evaluate_checkpoint
from omni_core.runtime.trainer import train
from tests.helpers.recipes import build_recipe
from tests.helpers.runtime import CPU, RecordingTracker


def test_checkpoints_to_s3_and_resumes_with_the_same_next_step_loss(tmp_path, s3_endpoint, monkeypatch):
    import boto3

    boto3.client("s3").create_bucket(Bucket="ckpt")
    straight = RecordingTracker()
    train(build_recipe(tmp_path / "local", {"train.steps": 4}), CPU, tracker=straight, log=lambda _: None)

    recipe = build_recipe(tmp_path / "s3",
                          {"train.steps": 4, "train.ckpt_every": 2, "train.ckpt_dir": "s3://ckpt/runs/tiny"})
    train(recipe, CPU, log=lambda _: None, stop_after=2)
    store = checkpoint_store(recipe)
    assert store.steps() == [2]
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="ckpt")["Contents"]}
    assert {"runs/tiny/step_000002/manifest.json", "runs/tiny/step_000002/.metadata",
            "runs/tiny/step_000002/rank0.pt"} <= keys

    import shutil

    shutil.rmtree(store.cache)  # a fresh machine: everything must come back from S3
    resumed = RecordingTracker()
    result = train(recipe, CPU, tracker=resumed, log=lambda _: None)
    assert result.resumed_from_step == 2 and result.checkpoint == "s3://ckpt/runs/tiny/step_000004"
    for step in (3, 4):
        assert resumed.metrics[step]["train/loss"] == pytest.approx(straight.metrics[step]["train/loss"], abs=1e-6)

    planted = "runs/tiny/step_000004/../../../escaped.txt"  # a key that would write outside the cache
    boto3.client("s3").put_object(Bucket="ckpt", Key=planted, Body=b"x")
    shutil.rmtree(store.cache)
    with pytest.raises(CheckpointError, match=r"not plain file names: runs/tiny/step_000004/\.\./"):
        evaluate_checkpoint(recipe, checkpoint="s3://ckpt/runs/tiny/step_000004")
    assert not any(tmp_path.rglob("escaped.txt"))
    boto3.client("s3").delete_object(Bucket="ckpt", Key=planted)

    boto3.client("s3").delete_object(Bucket="ckpt", Key="runs/tiny/step_000004/manifest.json")
    shutil.rmtree(store.cache)
    assert store.steps() == [2]
    with pytest.raises(CheckpointError, match=r"s3://ckpt/runs/tiny/step_000004 has no manifest.json"):
        evaluate_checkpoint(recipe, checkpoint="s3://ckpt/runs/tiny/step_000004")


def test_an_s3_endpoint_that_comes_up_late_is_retried_with_backoff(tmp_path, monkeypatch):
    """The store's client rides out an endpoint that refuses connections for its first seconds (a MinIO
    restarting): the listing started before any server listened, and answers once one does."""
    import socket
    import sys
    import threading
    from pathlib import Path

    from botocore.exceptions import ClientError

    from omni_core.runtime.ckpt_store import S3Store
    from omni_core.runtime.ranks import free_port
    from tests.servers import server_process

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    for key, value in {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()

    up, stop = threading.Event(), threading.Event()

    def serve_late() -> None:
        moto = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
        with server_process(moto, f"{url}/moto-api/", log=tmp_path / "moto.log"):
            up.set()
            stop.wait(120)

    server = threading.Thread(target=serve_late, daemon=True)
    server.start()
    try:
        # The port refused connections just before, and moto takes over a second to listen, so the listing's first
        # attempts were refused; NoSuchBucket is the late server's answer (it has no buckets).
        with pytest.raises(ClientError, match="NoSuchBucket"):
            S3Store("s3://late/ckpt", tmp_path / "cache").steps()
        assert up.wait(30)
    finally:
        stop.set()
        server.join(30)
