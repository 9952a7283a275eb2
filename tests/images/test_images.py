"""kvgate's images, built from docker/ on a locally imported Debian base, run as the chart and
the operator run them: non-root, read-only root filesystem, no capabilities, no network."""

from __future__ import annotations

import docker
import pytest
from docker.errors import ContainerError

from tests.images.conftest import BuiltImage, run_locked_down

pytestmark = pytest.mark.docker

RUN_AS = "10001:10001"
# What the admission image must answer.
ADMISSION_CHECK = ["admission-service", "--help"]
ADMISSION_EXPECTED = "usage: kvgate admission-service"


def python_in(client: docker.DockerClient, image: str, code: str) -> str:
    output = client.containers.run(
        image,
        ["-c", code],
        entrypoint="/opt/kvgate/bin/python",
        network_mode="none",
        read_only=True,
        tmpfs={"/tmp": "rw,size=64m"},
        remove=True,
        stdout=True,
        stderr=True,
    )
    return bytes(output).decode()


def test_admission_image_runs_the_admission_service_command(
    docker_client: docker.DockerClient, admission_image: BuiltImage
) -> None:
    output = run_locked_down(docker_client, admission_image.reference, ADMISSION_CHECK)
    assert ADMISSION_EXPECTED in output


def test_operator_image_runs_the_operator_command(
    docker_client: docker.DockerClient, operator_image: BuiltImage
) -> None:
    output = run_locked_down(docker_client, operator_image.reference, ["operator", "--help"])
    assert "--all-namespaces" in output and "--peering" in output


@pytest.mark.parametrize("which", ["admission", "operator"])
def test_images_run_as_the_unprivileged_user(
    docker_client: docker.DockerClient,
    admission_image: BuiltImage,
    operator_image: BuiltImage,
    which: str,
) -> None:
    image = {"admission": admission_image, "operator": operator_image}[which]
    config = docker_client.images.get(image.reference).attrs["Config"]
    assert config["User"] == RUN_AS  # numeric: runAsNonRoot can verify it
    assert config["Entrypoint"] == ["kvgate"]
    identity = python_in(
        docker_client,
        image.reference,
        "import getpass, os; print(os.getuid(), os.getgid(), getpass.getuser())",
    )
    assert identity.split() == ["10001", "10001", "kvgate"]


def test_the_admission_image_has_no_torch(
    docker_client: docker.DockerClient, admission_image: BuiltImage
) -> None:
    with pytest.raises(ContainerError) as failure:
        python_in(docker_client, admission_image.reference, "import torch")
    assert b"No module named 'torch'" in (failure.value.stderr or b"")
    # ... while kvgate and its service dependencies are there.
    found = python_in(
        docker_client,
        admission_image.reference,
        "import kvgate.cli, kvgate.operator.handlers, aiokafka, kopf; print('ok')",
    )
    assert found.strip() == "ok"
