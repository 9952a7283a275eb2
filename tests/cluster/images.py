"""kvgate's images for the cluster tier, built by the image tests' code and put into the cluster.

The admission and operator images are ``docker/*.Dockerfile`` built on the harness's local
Debian base (``tests/images``); the CPU executor is the admission image with the test shim of
``sim_executor/`` (a node here has no GPU). Each goes into the cluster's containerd with
``docker save | ctr images import``; the chart and the pools use ``imagePullPolicy: Never``.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import docker

from tests.admission_service.word_tokenizers import word_tokenizer
from tests.harness.kafka_image import ensure_kafka_image
from tests.harness.kube_cluster import KubeCluster
from tests.harness.system import Progress, cache_root
from tests.images.base import ensure_debian_base
from tests.images.conftest import build_image

SIM_EXECUTOR_DIR = Path(__file__).with_name("sim_executor")
CPU_EXECUTOR_DIR = Path(__file__).with_name("cpu_executor")
ADMISSION = "kvgate-test-admission:latest"
OPERATOR = "kvgate-test-operator:latest"
EXECUTOR_REPOSITORY = "kvgate-test-cluster-executor"
#: ``docker/executor.Dockerfile`` on the local base, and the same with the CPU shim on top.
EXECUTOR = "kvgate-test-executor:latest"
CPU_EXECUTOR = "kvgate-test-cpu-executor:latest"


@dataclass(frozen=True)
class ClusterImages:
    admission: str
    operator: str
    executor_repository: str
    kafka: str

    def executor(self, revision: int) -> str:
        return f"{self.executor_repository}:r{revision}"


def build_sim_executor(
    client: docker.DockerClient, base: str, revision: int, progress: Progress
) -> str:
    """The CPU executor image ``kvgate-test-cluster-executor:r<revision>`` FROM ``base``."""
    tag = f"{EXECUTOR_REPOSITORY}:r{revision}"
    progress(f"building {tag} from {base}")
    with tempfile.TemporaryDirectory(dir=cache_root()) as context:
        shutil.copy2(SIM_EXECUTOR_DIR / "Dockerfile", Path(context) / "Dockerfile")
        shutil.copy2(SIM_EXECUTOR_DIR / "kvgate", Path(context) / "kvgate")
        word_tokenizer(Path(context) / "tokenizer", seed=7)
        client.images.build(
            path=context,
            tag=tag,
            buildargs={"BASE_IMAGE": base, "REVISION": str(revision)},
            pull=False,
            rm=True,
            forcerm=True,
            network_mode="host",
        )
    return tag


def build_and_import(
    client: docker.DockerClient, docker_host: str, kube: KubeCluster, progress: Progress
) -> ClusterImages:
    """Build every image the tier needs (Docker's layer cache makes a rebuild quick) and
    import each into the cluster."""
    base = ensure_debian_base(client, cache_root(), progress)
    admission = build_image(client, "admission.Dockerfile", ADMISSION, base, progress).reference
    operator = build_image(client, "operator.Dockerfile", OPERATOR, base, progress).reference
    executors = [build_sim_executor(client, admission, revision, progress) for revision in (1, 2)]
    kafka = ensure_kafka_image(client, cache_root(), progress).reference
    for reference in (admission, operator, *executors, kafka):
        progress(f"importing {reference} into the cluster")
        kube.import_docker_image(docker_host, reference)
    return ClusterImages(admission, operator, EXECUTOR_REPOSITORY, kafka)


def build_cpu_executor(client: docker.DockerClient, progress: Progress) -> str:
    """The real executor image (torch, the packaged SmolLM2) with ``cpu_executor/``'s shim,
    which runs the operator's ``kvgate executor ... --device cuda`` on the CPU."""
    base = ensure_debian_base(client, cache_root(), progress)
    executor = build_image(client, "executor.Dockerfile", EXECUTOR, base, progress).reference
    progress(f"building {CPU_EXECUTOR} from {executor}")
    with tempfile.TemporaryDirectory(dir=cache_root()) as context:
        for name in ("Dockerfile", "kvgate"):
            shutil.copy2(CPU_EXECUTOR_DIR / name, Path(context) / name)
        client.images.build(
            path=context,
            tag=CPU_EXECUTOR,
            buildargs={"BASE_IMAGE": executor},
            pull=False,
            rm=True,
            forcerm=True,
            network_mode="host",
        )
    return CPU_EXECUTOR
