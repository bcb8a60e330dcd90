"""One training launch rendered for where it runs, from one `RunSpec`: a local process group (what the train
stage starts), a Kubernetes Indexed Job with a headless Service, a Kubeflow Trainer TrainJob, or a Slurm batch
script. Past one node, torchrun's c10d rendezvous meets on the first node (pod index 0, the allocation's first
host); under the TrainJob, Kubeflow Trainer's runtime sets it up."""

from __future__ import annotations

import math
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?")


@dataclass(frozen=True)
class RunSpec:
    """Where and how large one launch is. `recipe` and `result` are paths where the launch runs (inside the
    image, or on the cluster's shared filesystem); `name` names the Job and Service, or the Slurm job."""

    name: str
    recipe: str
    result: str
    nodes: int = 1
    ranks_per_node: int = 1
    image: str = "omni-train:latest"  # Kubernetes: infra/Dockerfile's image
    cpus_per_node: int = 2
    memory_gb: int = 8
    gpus_per_node: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    port: int = 29400  # the rendezvous
    max_restarts: int = 0  # torchrun restarts every rank after one fails; the launch resumes its last checkpoint
    overrides: tuple[str, ...] = ()  # the recipe's `--set key=value`s
    time_limit_s: float = 0.0  # the cluster enforces it (Slurm --time, the Job's activeDeadlineSeconds); 0: none
    partition: str = ""  # Slurm: the partition (empty: the cluster's default)
    nodelist: tuple[str, ...] = ()  # Slurm: the nodes to run on, one per node (empty: Slurm chooses)

    def __post_init__(self) -> None:
        if not _LABEL.fullmatch(self.name):
            raise ValueError(
                f"run name {self.name!r}: lower-case letters, digits and '-', at most 52 characters "
                "(it names Kubernetes objects and their pods' host names)"
            )
        for key in ("nodes", "ranks_per_node", "cpus_per_node", "memory_gb"):
            if getattr(self, key) < 1:
                raise ValueError(f"run {self.name}: {key}={getattr(self, key)} must be >= 1")
        if self.time_limit_s < 0:
            raise ValueError(f"run {self.name}: time_limit_s={self.time_limit_s} must be >= 0")
        if self.max_restarts < 0:
            raise ValueError(f"run {self.name}: max_restarts={self.max_restarts} must be >= 0")
        if self.nodelist and len(self.nodelist) != self.nodes:
            raise ValueError(f"run {self.name}: nodelist {list(self.nodelist)} for {self.nodes} node(s)")
        if self.gpus_per_node and self.gpus_per_node < self.ranks_per_node:
            raise ValueError(f"run {self.name}: {self.ranks_per_node} ranks per node on {self.gpus_per_node} GPUs")


def run_name(text: str) -> str:
    """`text` (an experiment's name) as a run name: lower case, other characters as '-', at most 52."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:52].strip("-") or "omni"


def torchrun_args(spec: RunSpec, endpoint: str | None = None) -> list[str]:
    """torchrun's arguments for the launch: standalone on one node, c10d rendezvous at `endpoint` on more."""
    if spec.nodes == 1:
        where = ["--standalone", "--nproc-per-node", str(spec.ranks_per_node)]
    elif endpoint is None:
        raise ValueError(f"run {spec.name}: {spec.nodes} nodes need a rendezvous endpoint")
    else:
        where = [
            "--nnodes",
            str(spec.nodes),
            "--nproc-per-node",
            str(spec.ranks_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            spec.name,
        ]
    return [*where, *entry_args(spec)]


def entry_args(spec: RunSpec) -> list[str]:
    """torchrun's restarts and the entry point with its arguments: what every target runs."""
    return [
        "--max-restarts",
        str(spec.max_restarts),
        "-m",
        "omni_core.runtime.launch",
        "--recipe",
        spec.recipe,
        "--result",
        spec.result,
        *(a for o in spec.overrides for a in ("--set", o)),
    ]


def local_command(spec: RunSpec, log_dir: str | None = None) -> list[str]:
    """The command of a launch on this machine (this interpreter's torchrun); `log_dir` is where torchrun keeps
    each worker's error file (a temporary folder of its own when None)."""
    if spec.nodes != 1:
        raise ValueError(f"run {spec.name}: a local launch is one node, got {spec.nodes}")
    logs = ["--log-dir", log_dir] if log_dir else []
    return [sys.executable, "-m", "torch.distributed.run", *logs, *torchrun_args(spec)]


def kubernetes_manifests(spec: RunSpec) -> list[dict]:
    """A headless Service (stable host names for the pods) and an Indexed Job of one pod per node; pod 0 hosts
    the rendezvous. The Job does not retry pods (backoffLimit 0): torchrun restarts ranks, the run resumes."""
    labels = {"app.kubernetes.io/name": "omni", "omni/run": spec.name}
    resources = _node_resources(spec)
    endpoint = f"{spec.name}-0.{spec.name}:{spec.port}"
    container = {
        "name": "train",
        "image": spec.image,
        "command": ["torchrun", *torchrun_args(spec, endpoint)],
        "env": [{"name": k, "value": v} for k, v in sorted(spec.env.items())],
        "ports": [{"name": "rendezvous", "containerPort": spec.port}],
        "resources": {"requests": resources, "limits": dict(resources)},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": spec.name, "labels": dict(labels)},
        "spec": {
            "clusterIP": "None",
            "selector": {"omni/run": spec.name},
            "ports": [{"name": "rendezvous", "port": spec.port}],
        },
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": spec.name, "labels": dict(labels)},
        "spec": {
            "completionMode": "Indexed",
            "completions": spec.nodes,
            "parallelism": spec.nodes,
            "backoffLimit": 0,
            **({"activeDeadlineSeconds": math.ceil(spec.time_limit_s)} if spec.time_limit_s else {}),
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {"subdomain": spec.name, "restartPolicy": "Never", "containers": [container]},
            },
        },
    }
    return [service, job]


def trainjob_manifest(spec: RunSpec, runtime: str = "torch-distributed") -> dict:
    """A Kubeflow Trainer TrainJob (trainer.kubeflow.org/v1alpha1) on the `runtime` ClusterTrainingRuntime: its
    JobSet runs one pod per node and gives torchrun the node count, ranks per node, node rank and rendezvous
    address as PET_* variables, so the command carries only the restarts and the entry point."""
    resources = _node_resources(spec)
    trainer = {
        "image": spec.image,
        "numNodes": spec.nodes,
        "numProcPerNode": spec.ranks_per_node,
        "command": ["torchrun", *entry_args(spec)],
        "env": [{"name": k, "value": v} for k, v in sorted(spec.env.items())],
        "resourcesPerNode": {"requests": resources, "limits": dict(resources)},
    }
    job = {"runtimeRef": {"name": runtime}, "trainer": trainer}
    if spec.time_limit_s:
        job["activeDeadlineSeconds"] = math.ceil(spec.time_limit_s)
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": spec.name, "labels": {"app.kubernetes.io/name": "omni", "omni/run": spec.name}},
        "spec": job,
    }


def _node_resources(spec: RunSpec) -> dict[str, str]:
    resources = {"cpu": str(spec.cpus_per_node), "memory": f"{spec.memory_gb}Gi"}
    if spec.gpus_per_node:
        resources["nvidia.com/gpu"] = str(spec.gpus_per_node)
    return resources


def slurm_script(spec: RunSpec, torchrun: Sequence[str] = ("torchrun",)) -> str:
    """An sbatch script: one task per node, each running `torchrun` (by default the README's set-up on the
    shared filesystem, on PATH), meeting at the allocation's first node's address."""
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.name}",
        f"#SBATCH --nodes={spec.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={spec.cpus_per_node}",
        f"#SBATCH --mem={spec.memory_gb}G",
    ]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    if spec.time_limit_s:
        lines.append(f"#SBATCH --time={math.ceil(spec.time_limit_s / 60)}")  # minutes
    if spec.partition:
        lines.append(f"#SBATCH --partition={spec.partition}")
    if spec.nodelist:
        lines.append(f"#SBATCH --nodelist={','.join(spec.nodelist)}")
    lines += [
        "set -euo pipefail",
        *(f"export {k}={shlex.quote(v)}" for k, v in sorted(spec.env.items())),
        'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        # the node's address as Slurm reaches it (NodeAddr: its name unless the cluster says otherwise)
        'head=$(scontrol show node "$first" | grep -o "NodeAddr=[^ ]*" | cut -d= -f2)',
    ]
    args = torchrun_args(spec, f"__HEAD__:{spec.port}")
    command = shlex.join(["srun", *torchrun, *args]).replace("__HEAD__", '"$head"')
    return "\n".join([*lines, command, ""])
