"""The Kubernetes work pool's base job template, rendered by Prefect's own Kubernetes worker for a flow run (no
cluster needed): the Job it would create is valid Kubernetes, runs in the training image's checkout with
/dev/shm sized for gloo, takes credentials only from a Secret, and gives a GPU count when asked."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "infra" / "k8s" / "base-job-template.json"
# Prefect's worker refuses a template without these two keys, though they are Job fields, not PodSpec ones; the
# API server drops them. They are taken out before the strict schema check.
WORKER_REQUIRED_EXTRAS = ("completions", "parallelism")


def rendered_job(values: dict) -> dict:
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(json.loads(TEMPLATE.read_text()),
                                                                                   values))
    config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="nightly-otter"))
    return config.job_manifest


def strictly_valid(job: dict) -> None:
    job = json.loads(json.dumps(job))
    for key in WORKER_REQUIRED_EXTRAS:
        job["spec"]["template"]["spec"].pop(key)
    kubernetes_validate.validate(yaml.safe_load(yaml.safe_dump(job)), "1.30.0", strict=True)


def test_the_worker_renders_a_valid_job_in_the_training_image(prefect_harness):
    job = rendered_job({"env": {"MLFLOW_TRACKING_URI": "http://mlflow.omni.svc:5000"}})
    strictly_valid(job)
    [container] = job["spec"]["template"]["spec"]["containers"]
    workdir = re.search(r"^WORKDIR (\S+)", (REPO / "infra" / "Dockerfile").read_text(), re.M).group(1)
    assert container["workingDir"] == workdir and container["image"] == "omni-train:latest"
    assert container["args"] == ["prefect", "flow-run", "execute"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow.omni.svc:5000" and env["OMP_NUM_THREADS"] == "1"
    assert not any("SECRET" in name or "PASSWORD" in name for name in env), "credentials belong in the Secret"
    assert container["envFrom"] == [{"secretRef": {"name": "omni-credentials"}}]
    [shm] = job["spec"]["template"]["spec"]["volumes"]
    assert shm["emptyDir"]["medium"] == "Memory" and {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert job["spec"]["backoffLimit"] == 0  # torchrun restarts ranks; Prefect reschedules an evicted pod


def test_a_deployment_asks_for_gpus_and_resources(prefect_harness):
    job = rendered_job({"gpus": 8, "cpu": "64", "memory": "900Gi", "image": "registry.local/omni-train:abc123"})
    strictly_valid(job)
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"cpu": "64", "memory": "900Gi", "nvidia.com/gpu": 8}
    assert container["image"] == "registry.local/omni-train:abc123"


def test_a_broken_value_is_caught_by_the_schema_check(prefect_harness):
    with pytest.raises(kubernetes_validate.ValidationError):
        strictly_valid(rendered_job({"finished_job_ttl": "a week"}))


def test_the_worker_manifests_are_valid_and_serve_the_pool_deploy_creates():
    documents = list(yaml.safe_load_all((REPO / "infra" / "k8s" / "prefect-worker.yaml").read_text()))
    for document in documents:
        kubernetes_validate.validate(document, "1.30.0", strict=True)
    [worker] = [d for d in documents if d["kind"] == "Deployment"]
    command = worker["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--pool") + 1] == "omni-kubernetes" and "kubernetes" in command
    accounts = {d["metadata"]["name"] for d in documents if d["kind"] == "ServiceAccount"}
    defaults = json.loads(TEMPLATE.read_text())["variables"]["properties"]
    assert defaults["service_account_name"]["default"] in accounts
    assert defaults["namespace"]["default"] == worker["metadata"]["namespace"]
