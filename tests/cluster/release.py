"""What the cluster tests share: the chart's values for the test images, an ExecutorPool of
them, and producing text requests and checking their results."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kvgate.protocol.records import InferenceResult, ResultStatus
from tests.admission_service.kafka_helpers import produce, read_results
from tests.cluster.images import ClusterImages
from tests.harness.kube_cluster import KubeCluster

if TYPE_CHECKING:
    from tests.cluster.conftest import ClusterHelm

CHART = Path(__file__).parents[2] / "charts" / "kvgate"
RELEASE = "kvgate"
NAMESPACE = "kvgate"
POOL = "cpu"
TOKEN_SECRET = "cpu-executor-token"


def chart_values(images: ClusterImages, **operator: Any) -> dict[str, Any]:
    return {
        "images": {
            "pullPolicy": "Never",
            "operator": {"repository": images.operator.split(":")[0], "tag": "latest"},
            "admission": {"repository": images.admission.split(":")[0], "tag": "latest"},
            "executor": {"repository": images.executor_repository, "tag": "r1"},
        },
        "operator": {"settings": {"pollIntervalS": 1, "resyncIntervalS": 5}, **operator},
    }


def write_values(tmp: Path, values: dict[str, Any]) -> Path:
    path = tmp / f"values-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def install_release(
    kube: KubeCluster, helm: ClusterHelm, values: Path, *, namespace: str = NAMESPACE
) -> None:
    """``helm install --wait`` of the chart as :data:`RELEASE` in ``namespace`` (created), and
    the executors' token Secret the pools there name."""
    helm.run(
        "install", RELEASE, str(CHART), "-n", namespace, "--create-namespace",
        "-f", str(values), "--wait", "--timeout", "240s", timeout_s=300,
    )  # fmt: skip
    kube.kubectl(
        "-n", namespace, "create", "secret", "generic", TOKEN_SECRET,
        f"--from-literal=token={uuid.uuid4().hex}",
    )  # fmt: skip


def uninstall_release(kube: KubeCluster, helm: ClusterHelm, *, namespace: str = NAMESPACE) -> None:
    """The pools first (while the operator still runs to let them go), then the release."""
    kube.kubectl("delete", "executorpools", "--all", "-n", namespace, check=False)
    helm.run("uninstall", RELEASE, "-n", namespace, "--wait", check=False)


def pool_manifest(
    images: ClusterImages,
    bootstrap: str,
    topics: dict[str, str],
    *,
    namespace: str = NAMESPACE,
    **spec: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "replicas": 2,
        "gpusPerExecutor": 1,
        "image": images.executor(1),
        "imagePullPolicy": "Never",
        "model": {"family": "llama", "path": "/opt/kvgate-test/model"},
        "kafka": {
            "bootstrapServers": bootstrap,
            "topics": topics,
            "groupId": f"{topics['requests']}-group",
            "createTopics": True,
        },
        "tokenSecret": {"name": TOKEN_SECRET, "key": "token"},
        "drainTimeoutSeconds": 60,
        **spec,
    }
    return {
        "apiVersion": "kvgate.dev/v1alpha1",
        "kind": "ExecutorPool",
        "metadata": {"name": POOL, "namespace": namespace},
        "spec": body,
    }


def get_json(kube: KubeCluster, *args: str) -> Any:
    return json.loads(kube.kubectl("get", *args, "-o", "json").stdout)


def pool_status(kube: KubeCluster, namespace: str = NAMESPACE) -> dict[str, Any]:
    return dict(get_json(kube, "executorpool", POOL, "-n", namespace).get("status", {}))


def pool_ready(
    kube: KubeCluster, replicas: int, image: str | None = None, namespace: str = NAMESPACE
) -> bool:
    status = pool_status(kube, namespace)
    if status.get("phase") != "Ready" or status.get("readyReplicas") != replicas:
        return False
    if image is None:
        return True
    pods = executor_pods(kube, namespace)
    return len(pods) == replicas and all(
        pod["spec"]["containers"][0]["image"] == image for pod in pods
    )


def executor_pods(kube: KubeCluster, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    selector = f"kvgate.dev/pool={POOL},app.kubernetes.io/component=executor"
    items = get_json(kube, "pods", "-n", namespace, "-l", selector)["items"]
    return [pod for pod in items if not pod["metadata"].get("deletionTimestamp")]


def text_requests(count: int, max_tokens: int = 8) -> list[dict[str, Any]]:
    return [
        {
            "request_id": f"r{uuid.uuid4().hex[:12]}",
            "prompt": " ".join(f"w{(i * 7 + j) % 400}" for j in range(6)),
            "max_tokens": max_tokens,
        }
        for i in range(count)
    ]


def answered_once(results: list[InferenceResult], requests: list[dict[str, Any]]) -> None:
    counts = Counter(result.request_id for result in results)
    wanted = {request["request_id"] for request in requests}
    assert set(counts) == wanted, f"missing {wanted - set(counts)}, extra {set(counts) - wanted}"
    assert all(count == 1 for count in counts.values()), counts.most_common(3)
    for result in results:
        assert result.status is ResultStatus.COMPLETED, result
        assert result.text, result


def run_requests(bootstrap: str, topics: dict[str, str], requests: list[dict[str, Any]]) -> None:
    asyncio.run(produce(bootstrap, topics["requests"], requests))


def collect(
    bootstrap: str, topics: dict[str, str], count: int, timeout_s: float = 180
) -> list[InferenceResult]:
    return asyncio.run(
        read_results(bootstrap, topics["results"], count, timeout_s=timeout_s, settle_s=2.0)
    )
