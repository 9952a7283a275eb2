"""The pieces around the real collector and Prometheus, without Go, Docker or Kafka: the Go
recipe's cache key, reading the file exporter's OTLP JSON, and following the chart's
ServiceMonitor to a container port."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from kvgate.operator.builders.admission import build_admission_deployment, build_admission_service
from kvgate.operator.builders.common import PoolRef
from kvgate.operator.models import parse_spec
from tests.chart.helm import Helm
from tests.chart.manifests import render
from tests.chart.value_sets import ValueSet
from tests.harness import otelcol, prometheus
from tests.operator.examples import FULL_SPEC
from tests.telemetry.service_monitor import (
    admission_scrape_endpoint,
    gateway_scrape_endpoint,
    kubernetes_scrape_config,
    resolve,
    static_scrape_config,
)

POOL = PoolRef(name="pool-a", namespace="serving", uid="0000-pool-a")


def test_the_recipe_hash_covers_go_version_tags_flags_and_files() -> None:
    recipe = prometheus.recipe()
    base = recipe.hash("go1.26.8")
    assert recipe.hash("go1.26.8") == base
    assert recipe.hash("go1.27.3") != base
    assert replace(recipe, tags=("remove_all_sd",)).hash("go1.26.8") != base
    assert replace(recipe, ldflags="-s").hash("go1.26.8") != base
    assert replace(recipe, files=("go.mod",)).hash("go1.26.8") != base
    assert otelcol.recipe().files == ("go.mod", "go.sum", "main.go")


def test_the_file_exporters_otlp_json_is_read_with_its_value_kinds() -> None:
    line = {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [{"key": "k8s.pod.name", "value": {"stringValue": "p"}}]
                },
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": "ab" * 16,
                                "spanId": "cd" * 8,
                                "parentSpanId": "",
                                "name": "kvgate.step",
                                "attributes": [
                                    {"key": "i", "value": {"intValue": "9007199254740993"}},
                                    {"key": "d", "value": {"doubleValue": 0.5}},
                                    {"key": "b", "value": {"boolValue": True}},
                                    {"key": "a", "value": {"arrayValue": {"values": [
                                        {"intValue": "1"}, {"stringValue": "x"}
                                    ]}}},
                                    {"key": "e", "value": {"arrayValue": {}}},
                                    {"key": "m", "value": {"kvlistValue": {"values": [
                                        {"key": "k", "value": {"stringValue": "v"}}
                                    ]}}},
                                ],
                                "links": [{"traceId": "01" * 16, "spanId": "02" * 8}],
                            }
                        ]
                    }
                ],
            }
        ]
    }  # fmt: skip
    [span] = otelcol.parse_traces_line(line)
    assert span.parent_span_id is None
    assert span.resource == {"k8s.pod.name": "p"}
    assert span.attributes == {
        "i": 9007199254740993,  # 64-bit integers arrive as strings, exactly
        "d": 0.5,
        "b": True,
        "a": [1, "x"],
        "e": [],
        "m": {"k": "v"},
    }
    assert span.links == [("01" * 16, "02" * 8)]
    odd = copy.deepcopy(line)
    odd["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"] = [
        {"key": "x", "value": {"someNewKind": 1}}
    ]
    with pytest.raises(ValueError, match="unknown OTLP value kind 'someNewKind'"):
        otelcol.parse_traces_line(odd)


def _monitor(**spec: Any) -> dict[str, Any]:
    base = {
        "endpoints": [
            {"port": "admin", "path": "/metrics", "interval": "1s", "scrapeTimeout": "1s"}
        ],
        "jobLabel": "app.kubernetes.io/component",
        "namespaceSelector": {"matchNames": ["serving"]},
        "selector": {
            "matchLabels": {
                "app.kubernetes.io/component": "admission",
                "app.kubernetes.io/managed-by": "kvgate-operator",
                "app.kubernetes.io/name": "kvgate",
            }
        },
    }
    return {"metadata": {"name": "kvgate-admission", "namespace": "kvgate"}, "spec": base | spec}


@pytest.fixture(scope="module")
def pod_spec() -> dict[str, Any]:
    spec = parse_spec(POOL.name, FULL_SPEC)
    deployment = build_admission_deployment(POOL, spec, image="a:1", admin_token="t")
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


def test_a_service_monitor_resolves_to_the_admission_container_port(
    pod_spec: dict[str, Any],
) -> None:
    endpoint = resolve(_monitor(), build_admission_service(POOL), pod_spec)
    assert (endpoint.job, endpoint.service_port, endpoint.container_port) == (
        "admission",
        "admin",
        8080,
    )
    config = kubernetes_scrape_config(endpoint, namespace="serving")
    assert config["kubernetes_sd_configs"] == [
        {"role": "endpoints", "namespaces": {"names": ["serving"]}}
    ]
    kept = {r["source_labels"][0]: r["regex"] for r in config["relabel_configs"] if "regex" in r}
    assert kept["__meta_kubernetes_service_label_app_kubernetes_io_component"] == "admission"
    assert kept["__meta_kubernetes_endpoint_port_name"] == "admin"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"endpoints": [{"port": "metrics", "interval": "1s", "scrapeTimeout": "1s"}]},
            "ports are",
        ),
        ({"selector": {"matchLabels": {"app.kubernetes.io/component": "x"}}}, "does not select"),
        ({"namespaceSelector": {"matchNames": ["other"]}}, "looks in"),
    ],
    ids=["port-renamed", "selector-mismatch", "namespace"],
)
def test_a_service_monitor_that_no_longer_reaches_the_pod_is_refused(
    pod_spec: dict[str, Any], change: dict[str, Any], message: str
) -> None:
    with pytest.raises(AssertionError, match=message):
        resolve(_monitor(**change), build_admission_service(POOL), pod_spec)


def test_a_service_port_targeting_a_missing_container_port_is_refused(
    pod_spec: dict[str, Any],
) -> None:
    service = copy.deepcopy(build_admission_service(POOL))
    service["spec"]["ports"][0]["targetPort"] = "metrics"
    with pytest.raises(AssertionError, match="targets 'metrics'"):
        resolve(_monitor(), service, pod_spec)


def test_the_charts_monitors_reach_the_admission_and_gateway_ports(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    value_set = ValueSet(
        "monitors",
        values={
            "operator": {"watch": {"namespaces": ["serving"]}},
            "serviceMonitor": {"enabled": True},
            "kafka": {"bootstrapServers": "kafka:9092"},
            "gateway": {"enabled": True, "namespace": "serving", "allowAnonymous": True},
        },
    )
    chart = render(
        Helm.create(tmp_path_factory.mktemp("helm")), value_set, tmp_path_factory.mktemp("v")
    )
    admission = admission_scrape_endpoint(chart, POOL)
    gateway = gateway_scrape_endpoint(chart)
    assert (admission.job, admission.container_port) == ("admission", 8080)
    assert (gateway.job, gateway.service_port, gateway.interval) == ("gateway", "health", "30s")
    assert static_scrape_config(gateway, ["10.0.0.7:8081"], namespace="serving", service="s")[
        "static_configs"
    ] == [
        {
            "targets": ["10.0.0.7:8081"],
            "labels": {
                "job": "gateway",
                "namespace": "serving",
                "service": "s",
                "endpoint": "health",
            },
        }
    ]
