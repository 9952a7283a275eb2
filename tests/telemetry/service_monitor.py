"""Prometheus scrape configs from the chart's ServiceMonitors, as the Prometheus Operator would
derive them, so that a Prometheus in a test scrapes what the chart tells one to.

A ServiceMonitor names Services by label selector and an endpoint by the Service port's *name*;
the Service's ``targetPort`` then names the pod's container port. :func:`resolve` follows that
chain through the manifests the operator builds (the Service and the pod template), failing
with what broke: a selector that no longer selects the Service, a port name that no longer
exists. :func:`static_scrape_config` is the scrape config for targets a test runs itself (on
127.0.0.1, where no Service exists); :func:`kubernetes_scrape_config` the one a Prometheus in a
cluster uses (Kubernetes service discovery of the Service's endpoints, relabelled as the
Prometheus Operator relabels them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.operator.builders.admission import (
    build_admission_config,
    build_admission_deployment,
    build_admission_service,
)
from kvgate.operator.builders.common import PoolRef
from kvgate.operator.models import parse_spec
from tests.chart.manifests import Manifest, Rendered, selects
from tests.operator.examples import FULL_SPEC


@dataclass(frozen=True)
class ScrapeEndpoint:
    """One ServiceMonitor endpoint, resolved to the container port it reaches."""

    monitor: str  # namespace/name of the ServiceMonitor
    job: str  # the Service's jobLabel value, the ``job`` label of the scraped series
    service_port: str  # the Service port's name, as the endpoint names it
    container_port: int  # what the pod listens on
    path: str
    interval: str
    timeout: str
    selector: dict[str, str]  # the ServiceMonitor's matchLabels


def resolve(monitor: Manifest, service: Manifest, pod_spec: Manifest) -> ScrapeEndpoint:
    """The ServiceMonitor's one endpoint, through ``service`` to a container of ``pod_spec``."""
    spec = monitor["spec"]
    name = f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"
    labels: dict[str, str] = service["metadata"].get("labels", {})
    namespaces = spec.get("namespaceSelector", {})
    if not namespaces.get("any") and service["metadata"]["namespace"] not in namespaces.get(
        "matchNames", [monitor["metadata"]["namespace"]]
    ):
        raise AssertionError(
            f"ServiceMonitor {name} looks in {namespaces}, not in the Service's namespace "
            f"{service['metadata']['namespace']}"
        )
    if set(spec["selector"]) != {"matchLabels"} or not selects(spec["selector"], labels):
        raise AssertionError(
            f"ServiceMonitor {name}: selector {spec['selector']} does not select (by "
            f"matchLabels) the Service's labels {labels}"
        )
    [endpoint] = spec["endpoints"]
    ports = {p.get("name"): p for p in service["spec"]["ports"]}
    if endpoint["port"] not in ports:
        raise AssertionError(
            f"ServiceMonitor {name} scrapes port {endpoint['port']!r}; the Service's ports are "
            f"{list(ports)}"
        )
    target = ports[endpoint["port"]].get("targetPort", ports[endpoint["port"]]["port"])
    container_ports = [p for c in pod_spec["containers"] for p in c.get("ports", [])]
    if isinstance(target, int):
        matched = [p for p in container_ports if p["containerPort"] == target]
    else:
        matched = [p for p in container_ports if p.get("name") == target]
    if len(matched) != 1:
        raise AssertionError(
            f"Service port {endpoint['port']!r} targets {target!r}; the pod's ports are "
            f"{container_ports}"
        )
    job_label = spec.get("jobLabel")
    return ScrapeEndpoint(
        monitor=name,
        job=labels[job_label] if job_label in labels else service["metadata"]["name"],
        service_port=endpoint["port"],
        container_port=int(matched[0]["containerPort"]),
        path=endpoint.get("path", "/metrics"),
        interval=endpoint["interval"],
        timeout=endpoint["scrapeTimeout"],
        selector=dict(spec["selector"]["matchLabels"]),
    )


def admission_scrape_endpoint(chart: Rendered, pool: PoolRef) -> ScrapeEndpoint:
    """The chart's admission ServiceMonitor through the Service and Deployment the operator
    builds for ``pool``, checked to reach the port its admission service is configured on."""
    spec = parse_spec(pool.name, FULL_SPEC)
    deployment = build_admission_deployment(pool, spec, image="a:1", admin_token="t")
    monitor = chart.one("ServiceMonitor", "kvgate-admission")
    endpoint = resolve(
        monitor, build_admission_service(pool), deployment["spec"]["template"]["spec"]
    )
    configured = build_admission_config(pool, spec)["admin"]["port"]
    if endpoint.container_port != configured:
        raise AssertionError(f"{endpoint} scrapes {endpoint.container_port}, not {configured}")
    return endpoint


def gateway_scrape_endpoint(chart: Rendered, name: str = "kvgate-gateway") -> ScrapeEndpoint:
    """The chart's gateway ServiceMonitor through the chart's headless Service and StatefulSet,
    checked to reach the port given as ``--health-port``; the client Service gives no target."""
    monitor = chart.one("ServiceMonitor", "kvgate-gateway")
    pod_spec: Manifest = chart.one("StatefulSet", name)["spec"]["template"]["spec"]
    endpoint = resolve(monitor, chart.one("Service", f"{name}-pods"), pod_spec)
    [container] = pod_spec["containers"]
    if f"--health-port={endpoint.container_port}" not in container["args"]:
        raise AssertionError(f"{endpoint} is not the --health-port of {container['args']}")
    try:
        resolve(monitor, chart.one("Service", name), pod_spec)
    except AssertionError:
        return endpoint  # the client Service has no such port: no targets from it
    raise AssertionError(f"the gateway's client Service {name} would be scraped too")


def _base(endpoint: ScrapeEndpoint) -> dict[str, Any]:
    return {
        "job_name": f"serviceMonitor/{endpoint.monitor}/0",
        "metrics_path": endpoint.path,
        "scrape_interval": endpoint.interval,
        "scrape_timeout": endpoint.timeout,
    }


def static_scrape_config(
    endpoint: ScrapeEndpoint, targets: list[str], *, namespace: str, service: str
) -> dict[str, Any]:
    """Scrape ``targets`` (host:port standing in for pod:container_port) as ``endpoint`` says,
    with the labels the Prometheus Operator's config gives each target."""
    labels = {
        "job": endpoint.job,
        "namespace": namespace,
        "service": service,
        "endpoint": endpoint.service_port,
    }
    return _base(endpoint) | {"static_configs": [{"targets": targets, "labels": labels}]}


def kubernetes_scrape_config(endpoint: ScrapeEndpoint, *, namespace: str) -> dict[str, Any]:
    """Kubernetes service discovery of the endpoints of Services matching ``endpoint``'s
    selector in ``namespace``, kept to its port name, relabelled as the Prometheus Operator does
    (``job`` from the jobLabel, ``namespace``, ``service``, ``pod``, ``endpoint``)."""
    keep = [
        {
            "source_labels": [f"__meta_kubernetes_service_label_{_label_name(key)}"],
            "regex": value,
            "action": "keep",
        }
        for key, value in endpoint.selector.items()
    ]
    keep.append(
        {
            "source_labels": ["__meta_kubernetes_endpoint_port_name"],
            "regex": endpoint.service_port,
            "action": "keep",
        }
    )
    relabel = [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "endpoint", "replacement": endpoint.service_port},
        {"target_label": "job", "replacement": endpoint.job},
    ]
    return _base(endpoint) | {
        "kubernetes_sd_configs": [{"role": "endpoints", "namespaces": {"names": [namespace]}}],
        "relabel_configs": keep + relabel,
    }


def _label_name(key: str) -> str:
    """A Kubernetes label key as Prometheus's discovery names it (``[^a-zA-Z0-9_]`` → ``_``)."""
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key)
