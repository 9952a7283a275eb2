"""Fixtures for the image tests: a Docker engine (found or started by the harness), a local
Debian base, and kvgate's images built from the Dockerfiles in docker/ on top of it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest
from docker.errors import BuildError

from tests.harness.docker_engine import docker_engine
from tests.harness.system import Progress, cache_root, progress_to
from tests.images.base import ensure_debian_base

REPOSITORY_ROOT = Path(__file__).parents[2]
# A build installs kvgate's dependencies from PyPI on first run (later runs hit Docker's layer
# cache); the client must wait that long for the build's answer.
_BUILD_TIMEOUT_S = 1800


@dataclass(frozen=True)
class BuiltImage:
    reference: str
    build_s: float


def _progress(config: pytest.Config) -> Progress:
    return progress_to(config.pluginmanager.get_plugin("terminalreporter"), "kvgate images")


@pytest.fixture(scope="session")
def docker_client(pytestconfig: pytest.Config) -> Iterator[docker.DockerClient]:
    with docker_engine(cache_root(), _progress(pytestconfig)) as engine:
        client = docker.DockerClient(base_url=engine.host, timeout=_BUILD_TIMEOUT_S)
        try:
            yield client
        finally:
            client.close()


@pytest.fixture(scope="session")
def debian_base(pytestconfig: pytest.Config, docker_client: docker.DockerClient) -> str:
    return ensure_debian_base(docker_client, cache_root(), _progress(pytestconfig))


def build_image(
    client: docker.DockerClient, dockerfile: str, tag: str, base: str, progress: Progress
) -> BuiltImage:
    """Build ``docker/<dockerfile>`` from the repository root FROM ``base`` (host network: the
    harness's engine has no bridge, and the build fetches packages)."""
    progress(f"building {tag} from docker/{dockerfile} on {base}")
    started = time.monotonic()
    try:
        client.images.build(
            path=str(REPOSITORY_ROOT),
            dockerfile=f"docker/{dockerfile}",
            tag=tag,
            buildargs={"BASE_IMAGE": base},
            pull=False,
            rm=True,
            forcerm=True,
            network_mode="host",
        )
    except BuildError as error:
        log = "".join(str(item.get("stream", item.get("error", ""))) for item in error.build_log)
        raise AssertionError(
            f"docker build of {dockerfile} failed: {error}\n{log[-6000:]}"
        ) from None
    return BuiltImage(tag, time.monotonic() - started)


@pytest.fixture(scope="session")
def admission_image(
    pytestconfig: pytest.Config, docker_client: docker.DockerClient, debian_base: str
) -> BuiltImage:
    return build_image(
        docker_client,
        "admission.Dockerfile",
        "kvgate-test-admission:latest",
        debian_base,
        _progress(pytestconfig),
    )


@pytest.fixture(scope="session")
def operator_image(
    pytestconfig: pytest.Config, docker_client: docker.DockerClient, debian_base: str
) -> BuiltImage:
    return build_image(
        docker_client,
        "operator.Dockerfile",
        "kvgate-test-operator:latest",
        debian_base,
        _progress(pytestconfig),
    )


def run_locked_down(
    client: docker.DockerClient,
    image: str,
    command: list[str],
    *,
    entrypoint: str | None = None,
    tmp_size: str = "64m",
) -> str:
    """Run like the operator's pods do: as the image's user, with a read-only root filesystem,
    no capabilities, no privilege escalation, a writable /tmp only, and no network at all."""
    output = client.containers.run(
        image,
        command,
        entrypoint=entrypoint,
        network_mode="none",
        read_only=True,
        tmpfs={"/tmp": f"rw,size={tmp_size}"},
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        remove=True,
        stdout=True,
        stderr=True,
    )
    return bytes(output).decode()
