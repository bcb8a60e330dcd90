"""`omni run` against real servers, as the README's "Pointing at real servers" and infra/ describe: an MLflow
tracking server on PostgreSQL whose artifacts go to S3 (moto's standalone server on loopback standing in for
MinIO), checkpoints written straight to S3, and a Prefect server instead of the ephemeral API (the test
harness's, a server process on loopback; test_deployments.py starts `prefect server start` itself).
Everything crosses real HTTP (and PostgreSQL's wire protocol)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from omni_core.runtime.ranks import free_port
from tests.helpers.recipes import write_recipe
from tests.servers import postgres_server, server_process

BIN = Path(sys.executable).parent
SERVERS = {"experiment.name": "servers", "data.synthetic.num_samples": 60, "data.seq_len": 256, "parallel.nproc": 1,
           "train.steps": 6, "train.log_every": 2, "train.ckpt_every": 0, "train.timeout_s": 300,
           "train.ckpt_dir": "s3://ckpt/servers", "eval.max_batches": 2, "tracking.flush_every_s": 0.5}


def test_omni_run_tracks_to_mlflow_on_postgres_with_s3_artifacts_and_a_prefect_server(tmp_path, prefect_api_url):
    import boto3
    from mlflow import MlflowClient

    creds = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    base_env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")}
    s3_port, mlflow_port, pg_port = free_port(), free_port(), free_port()
    s3_url = f"http://127.0.0.1:{s3_port}"
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    prefect_url = prefect_api_url
    server_env = {**base_env, **creds, "MLFLOW_S3_ENDPOINT_URL": s3_url, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}

    with server_process([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(s3_port)],
                        f"{s3_url}/moto-api/", log=tmp_path / "s3.log", env=server_env), \
            postgres_server(pg_port) as store_uri:
        s3 = boto3.client("s3", endpoint_url=s3_url, **{k.lower(): v for k, v in creds.items()
                                                         if k != "AWS_DEFAULT_REGION"}, region_name="us-east-1")
        s3.create_bucket(Bucket="mlflow")
        s3.create_bucket(Bucket="ckpt")
        mlflow_cmd = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
                      "--workers", "1", "--backend-store-uri", store_uri,
                      "--artifacts-destination", "s3://mlflow/artifacts"]
        with server_process(mlflow_cmd, f"{mlflow_url}/health", log=tmp_path / "mlflow.log", env=server_env):
            recipe = write_recipe(tmp_path / "recipe.yaml", SERVERS, tmp_path / "out")
            client_env = {**base_env, "MLFLOW_TRACKING_URI": mlflow_url, "PREFECT_API_URL": prefect_url,
                          "PREFECT_HOME": str(tmp_path / "prefect-client"), "OMP_NUM_THREADS": "1",
                          "AWS_ENDPOINT_URL": s3_url, **creds}
            proc = subprocess.run([str(BIN / "omni"), "run", str(recipe), "--json"], cwd=tmp_path, env=client_env,
                                  capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-4000:]
            summary = json.loads(proc.stdout.strip().splitlines()[-1])
            assert summary["tracking_uri"] == mlflow_url

            client = MlflowClient(mlflow_url)
            parent = client.get_run(summary["parent_run_id"])
            children = client.search_runs([parent.info.experiment_id],
                                          f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
            assert {r.info.run_name for r in children} == {"profile", "estimate", "train", "evaluate"}
            train = next(r for r in children if r.info.run_name == "train")
            assert [m.step for m in client.get_metric_history(train.info.run_id, "train/loss")] == [2, 4, 6]

            keys = [o["Key"] for o in s3.list_objects_v2(Bucket="mlflow").get("Contents", [])]
            assert any(k.endswith(f"{parent.info.run_id}/artifacts/recipe.yaml") for k in keys)
            recipe_back = client.download_artifacts(parent.info.run_id, "recipe.yaml", str(tmp_path / "back"))
            assert "servers" in Path(recipe_back).read_text()

            # The checkpoint itself went straight to S3; MLflow keeps its manifest (a pointer), read back here.
            ckpt_keys = [o["Key"] for o in s3.list_objects_v2(Bucket="ckpt").get("Contents", [])]
            assert "servers/step_000006/manifest.json" in ckpt_keys
            assert any(k.startswith("servers/step_000006/") and k.endswith(".distcp") for k in ckpt_keys)
            manifest = json.loads(s3.get_object(Bucket="ckpt", Key="servers/step_000006/manifest.json")["Body"].read())
            logged = client.download_artifacts(train.info.run_id, "checkpoint", str(tmp_path / "logged"))
            assert json.loads((Path(logged) / "manifest.json").read_text())["step"] == manifest["step"] == 6
            assert train.data.tags["checkpoint.uri"] == "s3://ckpt/servers/step_000006"

            import urllib.request

            request = urllib.request.Request(f"{prefect_url}/flow_runs/filter", data=b"{}", method="POST",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                flow_runs = json.loads(response.read())
            assert summary["run_name"].removeprefix("servers-") in {r["name"] for r in flow_runs}
