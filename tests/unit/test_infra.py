"""infra/ and prefect.yaml, checked without starting anything: the compose file parses, its services refer only to
images, services, volumes and variables it defines, publishes ports on loopback only, and every default
password is marked as one; the deployments file gives only deployments the CLI can serve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from flows.deploy import DeploymentError, load_deployments
from tests.helpers.recipes import write_recipe

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((INFRA / "docker-compose.yml").read_text())


def env_example() -> dict[str, str]:
    lines = (INFRA / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_compose_refers_only_to_what_it_defines(compose):
    services = compose["services"]
    assert {"postgres", "minio", "create-buckets", "mlflow", "prefect-server", "prefect-worker"} <= set(services)
    built = {s["image"] for s in services.values() if "build" in s}
    for name, service in services.items():
        image = service["image"]
        assert image in built or re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), \
            f"{name}: {image} is neither built here nor pinned"
        depends = service.get("depends_on", [])
        assert set(depends) <= set(services), name
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in compose["volumes"], f"{name}: volume {volume}"
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    assert (REPO / services["prefect-worker"]["build"]["dockerfile"]).is_file()
    used = set(re.findall(r"(?<!\$)\$\{(\w+)\}", (INFRA / "docker-compose.yml").read_text()))
    assert used == set(env_example()), "variables used vs defined in infra/.env.example"


def test_every_default_password_is_marked():
    for key, value in env_example().items():
        if "PASSWORD" in key:
            assert "# DEFAULT PASSWORD" in value, key


def test_the_image_installs_as_the_readme_does():
    dockerfile = (INFRA / "Dockerfile").read_text()
    pin = re.search(r"^TORCH_SPEC \?= (\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    assert f"ARG TORCH_SPEC={pin}" in dockerfile and "make install" in dockerfile


def test_shipped_deployments_pass_only_recipe_and_overrides():
    specs = load_deployments()
    assert {s.name for s in specs} == {"nightly-regression", "reprofile", "adhoc"}
    assert {s.name: bool(s.schedules) for s in specs} == {"nightly-regression": True, "reprofile": True, "adhoc": False}
    for spec in specs:
        assert set(spec.options()["parameters"]) == {"recipe", "overrides"}
        assert spec.options()["concurrency_limit"].limit == 1


@pytest.mark.parametrize("edit, message", [
    ("parameters: {recipe: recipe.yaml, steps: 3}", r"parameters must be `recipe` \(and `overrides`\)"),
    ("parameters: {recipe: missing.yaml}", r"its recipe does not resolve"),
    ("parameters: {recipe: recipe.yaml}\n    entrypoint: flows.nothing:flow", r"is not a flow of this package"),
    ("parameters: {recipe: recipe.yaml}\n    schedules: [{cron: '0 * * * *', interval: 5}]", r"each schedule is one of"),
])
def test_bad_deployments_are_refused_naming_the_file_and_deployment(edit, message, tmp_path):
    write_recipe(tmp_path / "recipe.yaml", {"experiment.name": "d"})
    entry = f"deployments:\n  - name: one\n    entrypoint: flows.profile:profile_flow\n    {edit}\n"
    (tmp_path / "prefect.yaml").write_text(entry)  # a repeated key: YAML keeps the last
    with pytest.raises(DeploymentError, match=message) as error:
        load_deployments(tmp_path / "prefect.yaml")
    assert f"{tmp_path / 'prefect.yaml'}: deployments[0] (one)" in str(error.value)
