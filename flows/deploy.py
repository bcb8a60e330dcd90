"""Deployments of omni's flows, as `prefect.yaml` declares them: `serve` runs them (schedules included) from
this process, `deploy` registers them with a work pool: a process pool, whose worker runs their flow runs in
this checkout, or a Kubernetes pool, whose worker starts each as a Job in the training image
(infra/k8s/base-job-template.json). The file is read and checked here, before Prefect is asked anything: each
deployment names a flow of this package, passes only `recipe` and `overrides`, and its recipe resolves."""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from omni_core.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parent.parent
DEPLOYMENTS_FILE = REPO / "prefect.yaml"
KUBERNETES_TEMPLATE = REPO / "infra" / "k8s" / "base-job-template.json"
PARAMETERS = {"recipe", "overrides"}
POOL_TYPES = ("process", "kubernetes")


class DeploymentError(ValueError):
    """A deployment prefect.yaml cannot give: the message names the file and the deployment."""


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    # flows.<module>:<flow function>, a module path: by file path Prefect puts flows/ first on sys.path, where
    # flows/profile.py hides the standard library's profile (torch imports cProfile)
    entrypoint: str
    recipe: str  # absolute: a flow run may start in another working directory
    overrides: tuple[str, ...] = ()
    description: str = ""
    schedules: tuple[dict[str, Any], ...] = ()
    concurrency: dict[str, Any] = field(default_factory=dict)

    def flow(self):
        module, function = self.entrypoint.split(":")
        return getattr(importlib.import_module(module), function)

    def options(self, recipe: str | None = None) -> dict[str, Any]:
        """What Prefect's `to_deployment` / `deploy` take, for this deployment (`recipe` instead of its own
        path, where the flow runs elsewhere)."""
        from prefect.client.schemas.objects import ConcurrencyLimitConfig
        from prefect.deployments.runner import EntrypointType
        from prefect.schedules import Cron, Interval

        schedules = [
            Cron(s["cron"], timezone=s.get("timezone"))
            if "cron" in s
            else Interval(timedelta(seconds=s["interval"]), timezone=s.get("timezone"))
            for s in self.schedules
        ]
        return {
            "name": self.name,
            "description": self.description,
            "schedules": schedules,
            "parameters": {"recipe": recipe or self.recipe, "overrides": list(self.overrides)},
            "concurrency_limit": ConcurrencyLimitConfig(**self.concurrency) if self.concurrency else None,
            "entrypoint_type": EntrypointType.MODULE_PATH,
        }


def load_deployments(path: Path = DEPLOYMENTS_FILE) -> list[DeploymentSpec]:
    """The deployments of `path`, each checked; one DeploymentError listing every problem."""
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise DeploymentError(f"{path}: {err}") from None
    entries = document.get("deployments") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise DeploymentError(f"{path}: needs a non-empty list `deployments`")
    specs, problems = [], []
    for i, entry in enumerate(entries):
        where = f"{path}: deployments[{i}] ({entry.get('name', '?') if isinstance(entry, dict) else '?'})"
        try:
            specs.append(_spec(entry, path.parent, where))
        except DeploymentError as err:
            problems.append(str(err))
    names = [s.name for s in specs]
    problems += [
        f"{path}: deployment name {n!r} is used twice" for n in sorted({n for n in names if names.count(n) > 1})
    ]
    if problems:
        raise DeploymentError("\n".join(problems))
    return specs


def _spec(entry: Any, root: Path, where: str) -> DeploymentSpec:
    if not isinstance(entry, dict) or not entry.get("name") or not entry.get("entrypoint"):
        raise DeploymentError(f"{where}: needs a `name` and an `entrypoint`")
    if not re.fullmatch(r"flows\.\w+:\w+", entry["entrypoint"]):
        raise DeploymentError(
            f"{where}: entrypoint {entry['entrypoint']!r} must be a module path, flows.<module>:<flow>"
        )
    params = entry.get("parameters") or {}
    if set(params) - PARAMETERS or "recipe" not in params:
        raise DeploymentError(f"{where}: parameters must be `recipe` (and `overrides`), got {sorted(params)}")
    overrides = params.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise DeploymentError(f"{where}: parameters.overrides must be a list of key=value strings")
    recipe = (root / params["recipe"]).resolve()
    try:
        load_recipe(recipe, overrides)
    except (RecipeError, OSError) as err:
        raise DeploymentError(f"{where}: its recipe does not resolve: {err}") from None
    schedules = entry.get("schedules") or []
    if not all(isinstance(s, dict) and ("cron" in s) != ("interval" in s) for s in schedules):
        raise DeploymentError(f"{where}: each schedule is one of {{cron: ...}} or {{interval: seconds}}")
    spec = DeploymentSpec(
        name=entry["name"],
        entrypoint=entry["entrypoint"],
        recipe=str(recipe),
        overrides=tuple(overrides),
        description=entry.get("description", ""),
        schedules=tuple(schedules),
        concurrency=entry.get("concurrency_limit") or {},
    )
    try:
        spec.flow()
    except (ValueError, ImportError, AttributeError) as err:
        raise DeploymentError(f"{where}: entrypoint {spec.entrypoint!r} is not a flow of this package: {err}") from None
    return spec


def serve(specs: list[DeploymentSpec]) -> None:
    """Serve every deployment from this process until interrupted: schedules fire, runs execute here."""
    from prefect import serve as prefect_serve

    prefect_serve(*(spec.flow().to_deployment(**spec.options()) for spec in specs))


def deploy(specs: list[DeploymentSpec], pool: str, pool_type: str = "process") -> list[str]:
    """Register every deployment with the work pool `pool` of `pool_type` (created when missing; a Kubernetes
    pool with omni's base job template). A process worker runs the flow runs in this checkout; in a Kubernetes
    pod the checkout is the image's, so recipes are passed relative to it. Returns the deployments' ids."""
    if pool_type not in POOL_TYPES:
        raise DeploymentError(f"work pool type {pool_type!r}: one of {', '.join(POOL_TYPES)}")
    kubernetes = pool_type == "kubernetes"
    recipes = [_in_image(spec) if kubernetes else spec.recipe for spec in specs]
    _ensure_pool(pool, pool_type, json.loads(KUBERNETES_TEMPLATE.read_text()) if kubernetes else None)
    job = {} if kubernetes else {"working_dir": str(REPO)}
    return [
        str(spec.flow().to_deployment(job_variables=job, **spec.options(recipe)).apply(work_pool_name=pool))
        for spec, recipe in zip(specs, recipes, strict=True)
    ]


def _in_image(spec: DeploymentSpec) -> str:
    """The deployment's recipe as the image's checkout holds it: relative to the repository."""
    try:
        return Path(spec.recipe).relative_to(REPO).as_posix()
    except ValueError:
        raise DeploymentError(
            f"deployment {spec.name}: its recipe {spec.recipe} is outside this repository, so the "
            "training image (a copy of it) does not hold it"
        ) from None


def _ensure_pool(pool: str, pool_type: str, template: dict[str, Any] | None) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type=pool_type, base_job_template=template or {}))
        except ObjectAlreadyExists:
            existing = client.read_work_pool(pool).type
            if existing != pool_type:
                raise DeploymentError(f"work pool {pool} exists with type {existing}, not {pool_type}") from None
