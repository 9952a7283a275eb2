"""NetworkPolicies and ServiceMonitors against the objects the operator really builds.

The pods and Services come from the operator's own builders (for the chart's example pool), and
the operator pod from the rendered Deployment, so a label renamed on either side fails here.
NetworkPolicy semantics are evaluated as the API defines them: a pod selected by any policy
accepts only what some rule of those policies admits (peer and port).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvgate.operator.builders import (
    PoolRef,
    build_admission_deployment,
    build_admission_service,
    build_executor_pod,
    build_executor_service,
)
from kvgate.operator.models import parse_spec
from kvgate.operator.naming import ADMIN_PORT, EXECUTOR_PORT
from tests.chart.conftest import rendered_set
from tests.chart.manifests import Manifest, Rendered, selects
from tests.chart.value_sets import PROMETHEUS_PEER

WITH_POLICIES = ["everything", "cluster-wide", "custom-release"]


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict[str, str]


def _namespace_labels(namespace: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": namespace}


def _peer_admits(peer: Manifest, policy_namespace: str, source: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # pod traffic is judged by selectors here
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], _namespace_labels(source.namespace)):
            return False
    elif source.namespace != policy_namespace:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], source.labels)


def admitted(policies: list[Manifest], target: Pod, source: Pod, port: int) -> bool:
    """Whether ``source`` may open ``port`` on ``target`` under these ingress policies."""
    applying = [
        p
        for p in policies
        if p["metadata"]["namespace"] == target.namespace
        and selects(p["spec"]["podSelector"], target.labels)
        and "Ingress" in p["spec"]["policyTypes"]
    ]
    if not applying:
        return True  # an unselected pod is open
    for policy in applying:
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            peers = rule.get("from")
            if not peers or any(
                _peer_admits(peer, policy["metadata"]["namespace"], source) for peer in peers
            ):
                return True
    return False


@dataclass(frozen=True)
class Cast:
    """The pods of the example pool and the operator, as the cluster would see them."""

    executor: Pod
    admission: Pod
    operator: Pod
    other_operator: Pod
    prometheus: Pod
    services: tuple[Manifest, ...]


def _cast(rendered: Rendered) -> Cast:
    pool = rendered.one("ExecutorPool")
    name, namespace = pool["metadata"]["name"], pool["metadata"]["namespace"]
    ref = PoolRef(name, namespace, "uid-1")
    spec = parse_spec(name, pool["spec"])
    executor = build_executor_pod(ref, spec, 0)
    deployment = build_admission_deployment(ref, spec, image="admission:1", admin_token="t")
    operator = rendered.operator()
    operator_labels = dict(operator["spec"]["template"]["metadata"]["labels"])
    operator_namespace = operator["metadata"]["namespace"]
    return Cast(
        executor=Pod(executor["metadata"]["name"], namespace, executor["metadata"]["labels"]),
        admission=Pod("admission", namespace, deployment["spec"]["template"]["metadata"]["labels"]),
        operator=Pod("operator", operator_namespace, operator_labels),
        other_operator=Pod(
            "operator-of-another-release",
            operator_namespace,
            {**operator_labels, "app.kubernetes.io/instance": "another-release"},
        ),
        prometheus=Pod(
            "prometheus", "monitoring", dict(PROMETHEUS_PEER["podSelector"]["matchLabels"])
        ),
        services=(build_executor_service(ref), build_admission_service(ref)),
    )


@pytest.fixture(params=WITH_POLICIES)
def with_policies(request: pytest.FixtureRequest, rendered_sets: dict[str, Rendered]) -> Rendered:
    return rendered_set(rendered_sets, request.param)


def test_only_admission_pods_reach_the_executors_step_port(with_policies: Rendered) -> None:
    policies = with_policies.of_kind("NetworkPolicy")
    cast = _cast(with_policies)
    assert admitted(policies, cast.executor, cast.admission, EXECUTOR_PORT)
    assert not admitted(policies, cast.executor, cast.admission, 9999)
    assert not admitted(policies, cast.executor, cast.operator, EXECUTOR_PORT)
    assert not admitted(policies, cast.executor, cast.executor, EXECUTOR_PORT)
    stranger = Pod("stranger", cast.executor.namespace, {"app": "web"})
    assert not admitted(policies, cast.executor, stranger, EXECUTOR_PORT)
    # The same labels in another namespace are not the pool's admission service.
    elsewhere = Pod("admission", "elsewhere", cast.admission.labels)
    assert not admitted(policies, cast.executor, elsewhere, EXECUTOR_PORT)


def test_only_the_operator_reaches_the_admin_api(with_policies: Rendered) -> None:
    policies = with_policies.of_kind("NetworkPolicy")
    cast = _cast(with_policies)
    assert admitted(policies, cast.admission, cast.operator, ADMIN_PORT)
    assert not admitted(policies, cast.admission, cast.operator, EXECUTOR_PORT)
    assert not admitted(policies, cast.admission, cast.other_operator, ADMIN_PORT)
    assert not admitted(policies, cast.admission, cast.executor, ADMIN_PORT)
    assert not admitted(policies, cast.admission, cast.admission, ADMIN_PORT)
    moved = Pod("operator", "elsewhere", cast.operator.labels)
    assert not admitted(policies, cast.admission, moved, ADMIN_PORT)


def test_metrics_peers_reach_both_ports_only_when_listed(
    rendered_sets: dict[str, Rendered],
) -> None:
    for name, listed in [("everything", True), ("custom-release", False)]:
        rendered = rendered_set(rendered_sets, name)
        policies = rendered.of_kind("NetworkPolicy")
        cast = _cast(rendered)
        assert admitted(policies, cast.executor, cast.prometheus, EXECUTOR_PORT) is listed
        assert admitted(policies, cast.admission, cast.prometheus, ADMIN_PORT) is listed


def test_policies_exist_where_pools_run(with_policies: Rendered) -> None:
    policies = with_policies.of_kind("NetworkPolicy")
    cast = _cast(with_policies)
    namespaces = {p["metadata"]["namespace"] for p in policies}
    assert cast.executor.namespace in namespaces
    for namespace in namespaces:
        names = sorted(
            p["metadata"]["name"] for p in policies if p["metadata"]["namespace"] == namespace
        )
        assert names == ["kvgate-admission", "kvgate-executors"]


def test_the_policy_evaluation_can_fail(rendered_sets: dict[str, Rendered]) -> None:
    """Without the policies everything is open, and a policy with a typo'd label protects
    nothing: the checks above would notice both."""
    rendered = rendered_set(rendered_sets, "everything")
    cast = _cast(rendered)
    assert admitted([], cast.executor, cast.operator, EXECUTOR_PORT)
    broken: list[Manifest] = []
    for policy in rendered.of_kind("NetworkPolicy"):
        copy: dict[str, Any] = {**policy, "spec": dict(policy["spec"])}
        copy["spec"]["podSelector"] = {"matchLabels": {"app.kubernetes.io/component": "executr"}}
        broken.append(copy)
    assert admitted(broken, cast.executor, cast.operator, EXECUTOR_PORT)


def test_service_monitors_scrape_the_operator_built_services(with_policies: Rendered) -> None:
    monitors = {m["metadata"]["name"]: m for m in with_policies.of_kind("ServiceMonitor")}
    cast = _cast(with_policies)
    assert set(monitors) == {"kvgate-executor", "kvgate-admission"}
    for service in cast.services:
        labels = service["metadata"]["labels"]
        [monitor] = [m for m in monitors.values() if selects(m["spec"]["selector"], labels)]
        ports = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
        assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
        where = monitor["spec"]["namespaceSelector"]
        assert where.get("any") is True or service["metadata"]["namespace"] in where["matchNames"]
        assert monitor["metadata"]["namespace"] == with_policies.value_set.namespace


def test_network_policies_are_on_by_default(rendered_sets: dict[str, Rendered]) -> None:
    assert rendered_set(rendered_sets, "defaults").of_kind("NetworkPolicy")
