"""The cluster tier's fixtures: one real single-node Kubernetes cluster per session.

``kube`` is a :class:`tests.harness.kube_cluster.KubeCluster`: ``kube.kubeconfig`` (admin),
``kube.kubectl(...)``, ``kube.api(method, path, body)``, ``kube.import_image_tar(tar)``,
``kube.import_docker_image(docker_host, reference)``, ``kube.node_ip`` (the bridge address,
which is also the apiserver's). Pod and Service addresses are reachable from the test process.
``cluster_helm`` runs helm against it, ``cluster_images`` builds kvgate's images and imports
them (``images.py``), ``kafka_bootstrap`` runs Kafka in a pod (``kafka.yaml``).
The whole tier is skipped, with the reason, only where it cannot run: no root or no Go.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import docker
import pytest

from tests.chart.helm import helm_binary
from tests.cluster.images import ClusterImages, build_and_import
from tests.harness.docker_engine import docker_engine
from tests.harness.kube_cluster import KubeCluster, kube_cluster
from tests.harness.system import cache_root, is_root, port_accepts, progress_to

T = TypeVar("T")
KAFKA_MANIFEST = Path(__file__).with_name("kafka.yaml")
KAFKA_SERVICE_IP = "10.96.0.20"


@pytest.fixture(scope="session")
def kube(pytestconfig: pytest.Config) -> Iterator[KubeCluster]:
    if not is_root():
        pytest.skip("the cluster tier needs root (network namespace, mounts, cgroups)")
    if shutil.which("go") is None:
        pytest.skip("the cluster tier needs Go (https://go.dev/dl/) to build Kubernetes")
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    with kube_cluster(progress_to(reporter, "kube cluster")) as cluster:
        yield cluster
        # Every test's traffic included: nothing of the cluster's left by an outside link.
        leaked = {rule: count for rule, count in cluster.egress_packets().items() if count}
        assert not leaked, f"cluster packets left the machine: {leaked}"


@dataclass(frozen=True)
class ClusterHelm:
    """helm (the chart tests' binary) against the cluster, with private, empty helm homes."""

    binary: Path
    home: Path
    kubeconfig: Path

    def run(
        self, *args: str, check: bool = True, timeout_s: float = 300
    ) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
            "KUBECONFIG": str(self.kubeconfig),
        }
        completed = subprocess.run(
            [str(self.binary), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
        )
        if check and completed.returncode != 0:
            raise AssertionError(
                f"helm {' '.join(args)} exited with {completed.returncode}:\n"
                f"{completed.stdout}\n{completed.stderr}"
            )
        return completed


@pytest.fixture(scope="session")
def cluster_helm(kube: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> ClusterHelm:
    return ClusterHelm(helm_binary(), tmp_path_factory.mktemp("cluster-helm"), kube.kubeconfig)


@pytest.fixture(scope="session")
def cluster_images(pytestconfig: pytest.Config, kube: KubeCluster) -> Iterator[ClusterImages]:
    """kvgate's admission, operator and CPU executor images and the Kafka image, built and
    imported into the cluster once per session."""
    progress = progress_to(pytestconfig.pluginmanager.get_plugin("terminalreporter"), "images")
    with docker_engine(cache_root(), progress) as engine:
        client = docker.DockerClient(base_url=engine.host, timeout=1800)
        try:
            yield build_and_import(client, engine.host, kube, progress)
        finally:
            client.close()


@pytest.fixture(scope="session")
def kafka_bootstrap(kube: KubeCluster, cluster_images: ClusterImages) -> str:
    """A Kafka broker running as a pod (``kafka.yaml``); its bootstrap address, which the
    test process and pods both reach."""
    manifest = KAFKA_MANIFEST.read_text().replace("KAFKA_IMAGE", cluster_images.kafka)
    kube.kubectl("apply", "-f", "-", input_text=manifest)
    kube.kubectl(
        "-n", "kafka", "rollout", "status", "statefulset/kafka", "--timeout=180s", timeout_s=200
    )
    bootstrap = f"{KAFKA_SERVICE_IP}:9092"
    wait_for(lambda: port_accepts(KAFKA_SERVICE_IP, 9092), "Kafka's Service", timeout_s=60)
    return bootstrap


def wait_for(condition: Callable[[], T], what: str, *, timeout_s: float = 60.0) -> T:
    """Poll ``condition`` until it returns something true; that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)
