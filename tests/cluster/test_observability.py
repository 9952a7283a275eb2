"""The OpenTelemetry Collector and Prometheus as pods in the real cluster, kvgate's pods
exporting to the Collector's Service and scraped by Prometheus through Kubernetes discovery.

Both images are one layer holding the harness's static binary (``tests/harness/otelcol.py``,
``tests/harness/prometheus.py``), written by ``image_tar_from_directory`` and imported into the
cluster's containerd. The Collector's file exporter writes to a hostPath directory the test
reads; Prometheus runs under a ServiceAccount allowed to list Services, Endpoints and Pods, with
the scrape config the chart's admission ServiceMonitor amounts to
(``tests/telemetry/service_monitor.py``: Kubernetes endpoints discovery, kept by the
ServiceMonitor's selector and port name). The chart is installed in a namespace of its own with
an ExecutorPool whose ``spec.telemetry.otlpEndpoint`` is the Collector Service's DNS name; text
requests go through the in-cluster Kafka. The spans read back carry the real pod's name and
namespace and the pool; Prometheus answers for the real admission pod.
"""

from __future__ import annotations

import json
import shutil
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.operator.builders.common import PoolRef
from tests.chart.helm import Helm
from tests.chart.manifests import render
from tests.chart.value_sets import ValueSet
from tests.cluster.conftest import ClusterHelm, wait_for
from tests.cluster.images import ClusterImages
from tests.cluster.release import (
    answered_once,
    chart_values,
    collect,
    get_json,
    install_release,
    pool_manifest,
    pool_ready,
    run_requests,
    text_requests,
    uninstall_release,
    write_values,
)
from tests.harness import otelcol, prometheus
from tests.harness.kube_cluster import KubeCluster, http_get
from tests.harness.oci_archive import image_tar_from_directory
from tests.harness.system import cache_root, log_progress
from tests.telemetry.otlp_receivers import ReceivedSpan
from tests.telemetry.service_monitor import admission_scrape_endpoint, kubernetes_scrape_config

pytestmark = [pytest.mark.cluster, pytest.mark.observability, pytest.mark.timeout(900)]

NAMESPACE = "kvgate-obs"
OBSERVABILITY = "observability"
POOL = "cpu"
PROMETHEUS_IP = "10.96.0.31"  # a fixed Service address the test process reaches
COLLECTOR = f"http://otel-collector.{OBSERVABILITY}:4318"


def _image(binary: Path, reference: str, tmp: Path) -> Path:
    root = tmp / reference.split(":", maxsplit=1)[0]
    root.mkdir()
    shutil.copy2(binary, root / binary.name)
    return image_tar_from_directory(root, reference, [f"/{binary.name}"], tmp / f"{root.name}.tar")


def _collector_config() -> dict[str, Any]:
    return otelcol.collector_config(
        grpc="0.0.0.0:4317", http="0.0.0.0:4318", traces_file=Path("/out/traces.jsonl")
    )


def _manifests(spans_dir: Path, scrape: dict[str, Any]) -> list[dict[str, Any]]:
    ns = {"namespace": OBSERVABILITY}
    prometheus_config = {
        "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
        "scrape_configs": [scrape],
    }
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OBSERVABILITY}},
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "otelcol", **ns},
            "data": {"config.yaml": yaml.safe_dump(_collector_config())},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "otel-collector", **ns},
            "spec": {
                "selector": {"matchLabels": {"app": "otel-collector"}},
                "template": {
                    "metadata": {"labels": {"app": "otel-collector"}},
                    "spec": {
                        "containers": [
                            {
                                "name": "otelcol",
                                "image": "kvgate-test-otelcol:latest",
                                "imagePullPolicy": "Never",
                                "args": ["--config=/etc/otelcol/config.yaml"],
                                "ports": [
                                    {"name": "otlp-grpc", "containerPort": 4317},
                                    {"name": "otlp-http", "containerPort": 4318},
                                ],
                                "volumeMounts": [
                                    {"name": "config", "mountPath": "/etc/otelcol"},
                                    {"name": "out", "mountPath": "/out"},
                                ],
                            }
                        ],
                        "volumes": [
                            {"name": "config", "configMap": {"name": "otelcol"}},
                            {"name": "out", "hostPath": {"path": str(spans_dir)}},
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "otel-collector", **ns},
            "spec": {
                "selector": {"app": "otel-collector"},
                "ports": [
                    {"name": "otlp-grpc", "port": 4317, "targetPort": 4317},
                    {"name": "otlp-http", "port": 4318, "targetPort": 4318},
                ],
            },
        },
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "prometheus", **ns}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "kvgate-test-prometheus"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["services", "endpoints", "pods"],
                    "verbs": ["get", "list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "kvgate-test-prometheus"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "kvgate-test-prometheus",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "prometheus", **ns}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "prometheus", **ns},
            "data": {"prometheus.yml": yaml.safe_dump(prometheus_config, sort_keys=False)},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "prometheus", **ns},
            "spec": {
                "selector": {"matchLabels": {"app": "prometheus"}},
                "template": {
                    "metadata": {"labels": {"app": "prometheus"}},
                    "spec": {
                        "serviceAccountName": "prometheus",
                        "containers": [
                            {
                                "name": "prometheus",
                                "image": "kvgate-test-prometheus:latest",
                                "imagePullPolicy": "Never",
                                "args": [
                                    "--config.file=/etc/prometheus/prometheus.yml",
                                    "--storage.tsdb.path=/data",
                                    "--web.listen-address=:9090",
                                ],
                                "ports": [{"name": "http", "containerPort": 9090}],
                                "volumeMounts": [
                                    {"name": "config", "mountPath": "/etc/prometheus"},
                                    {"name": "data", "mountPath": "/data"},
                                ],
                            }
                        ],
                        "volumes": [
                            {"name": "config", "configMap": {"name": "prometheus"}},
                            {"name": "data", "emptyDir": {}},
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "prometheus", **ns},
            "spec": {
                "clusterIP": PROMETHEUS_IP,
                "selector": {"app": "prometheus"},
                "ports": [{"name": "http", "port": 9090, "targetPort": 9090}],
            },
        },
    ]


@pytest.fixture(scope="module")
def spans_dir(kube: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The Collector and Prometheus running in the cluster; the Collector's output directory."""
    tmp = tmp_path_factory.mktemp("observability")
    for binary, reference in [
        (otelcol.build(log_progress), "kvgate-test-otelcol:latest"),
        (prometheus.build(log_progress), "kvgate-test-prometheus:latest"),
    ]:
        kube.import_image_tar(_image(binary, reference, tmp))
    out = Path(cache_root()) / "kube-cluster-otel" / uuid.uuid4().hex[:8]
    out.mkdir(parents=True)
    out.chmod(0o777)
    rendered = render(
        Helm.create(tmp / "helm"),
        ValueSet(
            "monitoring",
            namespace=NAMESPACE,
            values={
                "serviceMonitor": {"enabled": True},
                "operator": {"watch": {"namespaces": [NAMESPACE]}},
            },
        ),
        tmp,
    )
    endpoint = admission_scrape_endpoint(rendered, PoolRef(POOL, NAMESPACE, "uid"))
    scrape = kubernetes_scrape_config(endpoint, namespace=NAMESPACE)
    manifests = _manifests(out, scrape)
    kube.kubectl("apply", "-f", "-", input_text="\n---\n".join(json.dumps(m) for m in manifests))
    try:
        for name in ("otel-collector", "prometheus"):
            kube.kubectl(
                "-n", OBSERVABILITY, "rollout", "status", f"deployment/{name}", "--timeout=120s",
                timeout_s=150,
            )  # fmt: skip
        yield out
    finally:
        kube.kubectl("delete", "namespace", OBSERVABILITY, "--wait=false", check=False)
        kube.kubectl(
            "delete", "clusterrolebinding,clusterrole", "kvgate-test-prometheus", check=False
        )
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def pool_release(
    kube: KubeCluster,
    cluster_helm: ClusterHelm,
    cluster_images: ClusterImages,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    values = write_values(tmp_path_factory.mktemp("obs-release"), chart_values(cluster_images))
    install_release(kube, cluster_helm, values, namespace=NAMESPACE)
    try:
        yield
    finally:
        uninstall_release(kube, cluster_helm, namespace=NAMESPACE)


def _spans(spans_dir: Path) -> list[ReceivedSpan]:
    spans: list[ReceivedSpan] = []
    for path in spans_dir.glob("*.jsonl"):
        complete = path.read_text().rpartition("\n")[0]
        for line in complete.splitlines():
            if line.strip():
                spans += otelcol.parse_traces_line(json.loads(line))
    return spans


def _query(expression: str) -> list[tuple[dict[str, str], float]]:
    url = f"http://{PROMETHEUS_IP}:9090/api/v1/query?" + urllib.parse.urlencode(
        {"query": expression}
    )
    status, body = http_get(url, timeout_s=5)
    assert status == 200, (status, body)
    result = json.loads(body)["data"]["result"]
    return [(dict(item["metric"]), float(item["value"][1])) for item in result]


def test_pool_pods_export_to_the_collector_and_are_scraped_by_prometheus(
    kube: KubeCluster,
    spans_dir: Path,
    pool_release: None,
    cluster_images: ClusterImages,
    kafka_bootstrap: str,
) -> None:
    base = f"ob{uuid.uuid4().hex[:8]}"
    topics = {
        "requests": f"{base}.requests",
        "results": f"{base}.results",
        "aborts": f"{base}.aborts",
        "deadLetter": f"{base}.dlq",
    }
    pool = pool_manifest(
        cluster_images, kafka_bootstrap, topics, namespace=NAMESPACE, replicas=1,
        telemetry={"otlpEndpoint": COLLECTOR},
    )  # fmt: skip
    kube.kubectl("apply", "-f", "-", input_text=json.dumps(pool))
    wait_for(lambda: pool_ready(kube, 1, namespace=NAMESPACE), "the pool Ready", timeout_s=240)
    requests = text_requests(4)
    run_requests(kafka_bootstrap, topics, requests)
    answered_once(collect(kafka_bootstrap, topics, len(requests)), requests)

    selector = f"kvgate.dev/pool={POOL},app.kubernetes.io/component=admission"
    [admission_pod] = get_json(kube, "pods", "-n", NAMESPACE, "-l", selector)["items"]
    pod_name = admission_pod["metadata"]["name"]
    ids = {request["request_id"] for request in requests}

    def served(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.attributes.get("gen_ai.response.id") in ids]

    spans = wait_for(
        lambda: (found := _spans(spans_dir)) and len(served(found)) == len(ids) and found,
        "the requests' spans in the Collector's output",
        timeout_s=60,
    )
    for span in served(spans):
        assert span.name.startswith("text_completion "), span.name
        assert span.resource["k8s.pod.name"] == pod_name
        assert span.resource["k8s.namespace.name"] == NAMESPACE
        assert span.resource["kvgate.pool"] == POOL
        assert span.resource["service.name"] == "kvgate-admission"
        assert span.attributes["gen_ai.request.model"] == "/opt/kvgate-test/model"
    request_ids = {(s.trace_id, s.span_id) for s in served(spans)}
    round_trips = [s for s in spans if s.name == "kvgate.step.round_trip"]
    assert request_ids <= {link for s in round_trips for link in s.links}

    up = wait_for(
        lambda: [s for s in _query(f'up{{job="admission",namespace="{NAMESPACE}"}}') if s[1] == 1],
        "Prometheus scraping the admission pod",
        timeout_s=90,
    )
    assert [labels["pod"] for labels, _ in up] == [pod_name]
    completed = wait_for(
        lambda: [
            v
            for _, v in _query(
                f'sum(kvgate_admission_results_total{{namespace="{NAMESPACE}",status="completed"}})'
            )
            if v >= len(requests)
        ],
        "the completed results counted in Prometheus",
        timeout_s=60,
    )
    assert completed == [len(requests)]
