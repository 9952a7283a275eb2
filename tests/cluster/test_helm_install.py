"""kvgate installed with ``helm install --wait`` on the real cluster, end to end.

The chart (operator, RBAC, CRD, NetworkPolicies) from ``charts/kvgate`` with the test images
and ``imagePullPolicy: Never``; an ExecutorPool of CPU executors (the sim-executor shim image,
``sim_executor/``) on the node's fake GPUs; Kafka in a pod. Text requests go from the test
process to the in-cluster Kafka, through the pool's admission service (which fetches the
tokenizer from the executors) to the executors and back as text. Then: scaling with work in
flight, a rolling update of the executor image, ``helm upgrade``, refusals of bad values and
bad pools, the NetworkPolicies against the running pods, and last ``helm uninstall`` with the
controller-manager's garbage collection. The tests share one release and run in file order.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import ClusterHelm, wait_for
from tests.cluster.images import ClusterImages
from tests.cluster.release import (
    CHART,
    NAMESPACE,
    POOL,
    RELEASE,
    TOKEN_SECRET,
    answered_once,
    chart_values,
    collect,
    executor_pods,
    get_json,
    install_release,
    pool_manifest,
    pool_ready,
    pool_status,
    run_requests,
    text_requests,
    uninstall_release,
    write_values,
)
from tests.harness.kube_cluster import KubeCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def topics() -> dict[str, str]:
    base = f"cl{uuid.uuid4().hex[:8]}"
    return {
        "requests": f"{base}.requests",
        "results": f"{base}.results",
        "aborts": f"{base}.aborts",
        "deadLetter": f"{base}.dlq",
    }


@pytest.fixture(scope="module")
def release(
    kube: KubeCluster,
    cluster_helm: ClusterHelm,
    cluster_images: ClusterImages,
    kafka_bootstrap: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Path]:
    """The chart installed (``--wait``); yields the values file. Uninstalled by the last test
    (and here, if that test did not get to it)."""
    tmp = tmp_path_factory.mktemp("release")
    values = write_values(tmp, chart_values(cluster_images))
    install_release(kube, cluster_helm, values)
    yield values
    if cluster_helm.run("status", RELEASE, "-n", NAMESPACE, check=False).returncode == 0:
        uninstall_release(kube, cluster_helm)


def test_install_then_text_in_text_out(
    kube: KubeCluster,
    release: Path,
    cluster_images: ClusterImages,
    kafka_bootstrap: str,
    topics: dict[str, str],
) -> None:
    operator = get_json(kube, "deployment", "kvgate-operator", "-n", NAMESPACE)
    assert operator["status"].get("readyReplicas") == 1
    pool = pool_manifest(cluster_images, kafka_bootstrap, topics)
    kube.kubectl("apply", "-f", "-", input_text=json.dumps(pool))
    wait_for(lambda: pool_ready(kube, 2), "the pool's 2 executors Ready", timeout_s=240)
    requests = text_requests(6)
    run_requests(kafka_bootstrap, topics, requests)
    results = collect(kafka_bootstrap, topics, len(requests))
    answered_once(results, requests)
    assert {pod["spec"]["nodeName"] for pod in executor_pods(kube)} == {kube.node_name}


def _labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the chart's policies use labels only
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_network_policies_select_the_running_pods(kube: KubeCluster, release: Path) -> None:
    """The bridge CNI does not enforce NetworkPolicies (docs/deployment.md); what can be
    checked is that each policy selects the pods and container ports it is meant for, among
    the pods actually running, and that its sources are the pods meant to call them."""
    policies = {
        item["metadata"]["name"]: item["spec"]
        for item in get_json(kube, "networkpolicy", "-n", NAMESPACE)["items"]
    }
    assert set(policies) == {"kvgate-executors", "kvgate-admission"}
    pods = get_json(kube, "pods", "-n", NAMESPACE)["items"]
    by_component: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        component = pod["metadata"]["labels"].get("app.kubernetes.io/component", "")
        by_component.setdefault(component, []).append(pod)
    assert by_component.get("executor") and by_component.get("admission"), by_component.keys()

    def selected(selector: dict[str, Any]) -> set[str]:
        return {
            pod["metadata"]["name"]
            for pod in pods
            if _labels_match(selector, pod["metadata"]["labels"])
        }

    def ports(pods_: list[dict[str, Any]]) -> set[int]:
        return {
            port["containerPort"]
            for pod in pods_
            for container in pod["spec"]["containers"]
            for port in container.get("ports", [])
        }

    names = {c: {pod["metadata"]["name"] for pod in found} for c, found in by_component.items()}
    executors = policies["kvgate-executors"]
    assert selected(executors["podSelector"]) == names["executor"]
    (rule,) = executors["ingress"]
    assert [p["port"] for p in rule["ports"]] == [8000]
    assert ports(by_component["executor"]) == {8000}
    assert selected(rule["from"][0]["podSelector"]) == names["admission"]

    admission = policies["kvgate-admission"]
    assert selected(admission["podSelector"]) == names["admission"]
    (rule,) = admission["ingress"]
    assert [p["port"] for p in rule["ports"]] == [8080]
    assert 8080 in ports(by_component["admission"])
    source = rule["from"][0]
    assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE}
    namespace_labels = get_json(kube, "namespace", NAMESPACE)["metadata"]["labels"]
    assert _labels_match(source["namespaceSelector"], namespace_labels)
    assert selected(source["podSelector"]) == names["operator"]


def test_scale_up_and_down_with_work_in_flight(
    kube: KubeCluster, release: Path, kafka_bootstrap: str, topics: dict[str, str]
) -> None:
    before = len(collect(kafka_bootstrap, topics, 0, timeout_s=30))
    requests = text_requests(40, max_tokens=24)
    run_requests(kafka_bootstrap, topics, requests[:20])
    kube.kubectl("scale", "executorpool", POOL, "-n", NAMESPACE, "--replicas=3")
    wait_for(lambda: pool_ready(kube, 3), "3 executors Ready", timeout_s=180)
    run_requests(kafka_bootstrap, topics, requests[20:])
    kube.kubectl("scale", "executorpool", POOL, "-n", NAMESPACE, "--replicas=1")
    wait_for(lambda: pool_ready(kube, 1), "the pool drained to 1 executor", timeout_s=240)
    results = collect(kafka_bootstrap, topics, before + len(requests))
    ids = {request["request_id"] for request in requests}
    answered_once([r for r in results if r.request_id in ids], requests)


def test_rolling_update_of_the_executor_image(
    kube: KubeCluster,
    release: Path,
    cluster_images: ClusterImages,
    kafka_bootstrap: str,
    topics: dict[str, str],
) -> None:
    kube.kubectl("scale", "executorpool", POOL, "-n", NAMESPACE, "--replicas=2")
    wait_for(lambda: pool_ready(kube, 2), "2 executors Ready", timeout_s=180)
    before = len(collect(kafka_bootstrap, topics, 0, timeout_s=30))
    old_uids = {pod["metadata"]["uid"] for pod in executor_pods(kube)}
    requests = text_requests(30, max_tokens=24)
    run_requests(kafka_bootstrap, topics, requests)
    image = cluster_images.executor(2)
    patch = {"spec": {"image": image}}
    kube.kubectl(
        "patch", "executorpool", POOL, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch)
    )
    wait_for(lambda: pool_ready(kube, 2, image), "every executor on the new image", timeout_s=300)
    assert not old_uids & {pod["metadata"]["uid"] for pod in executor_pods(kube)}
    results = collect(kafka_bootstrap, topics, before + len(requests))
    ids = {request["request_id"] for request in requests}
    answered_once([r for r in results if r.request_id in ids], requests)


def _admission_pods(kube: KubeCluster) -> list[dict[str, Any]]:
    selector = f"kvgate.dev/pool={POOL},app.kubernetes.io/component=admission"
    items = get_json(kube, "pods", "-n", NAMESPACE, "-l", selector)["items"]
    return [pod for pod in items if not pod["metadata"].get("deletionTimestamp")]


def _shards(kube: KubeCluster) -> dict[str, set[str]]:
    """Admission pod -> the executors the pool's status says it drives."""
    shards: dict[str, set[str]] = {}
    for entry in pool_status(kube).get("executors", []):
        if entry.get("admission"):
            shards.setdefault(entry["admission"], set()).add(entry["name"])
    return shards


def test_two_admission_replicas_and_one_killed(
    kube: KubeCluster, release: Path, kafka_bootstrap: str, topics: dict[str, str]
) -> None:
    """``spec.admission.replicas: 2``: each replica drives one of the two executors; one
    admission pod is killed (deleted with no grace period) under load, the other takes its
    executor and partitions, and every request is answered once."""
    patch = {"spec": {"admission": {"replicas": 2}}}
    kube.kubectl(
        "patch", "executorpool", POOL, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch)
    )

    def split() -> dict[str, set[str]] | None:
        names = {pod["metadata"]["name"] for pod in _admission_pods(kube)}
        shards = _shards(kube)
        ok = len(names) == 2 and set(shards) == names and all(len(v) == 1 for v in shards.values())
        return shards if ok and pool_ready(kube, 2) else None

    shards = wait_for(split, "one executor per admission replica", timeout_s=240)
    before = len(collect(kafka_bootstrap, topics, 0, timeout_s=30))
    requests = text_requests(40, max_tokens=24)
    run_requests(kafka_bootstrap, topics, requests[:20])
    victim = sorted(shards)[0]
    killed_at = time.monotonic()
    kube.kubectl("delete", "pod", victim, "-n", NAMESPACE, "--grace-period=0", "--force")
    run_requests(kafka_bootstrap, topics, requests[20:])
    results = collect(kafka_bootstrap, topics, before + len(requests), timeout_s=240)
    answered_s = time.monotonic() - killed_at
    ids = {request["request_id"] for request in requests}
    answered_once([r for r in results if r.request_id in ids], requests)
    # The victim's executor was driven by a survivor meanwhile, then shared out again.
    print(f"admission pod killed: every request answered {answered_s:.1f} s after the kill")
    wait_for(split, "the replacement replica's share", timeout_s=240)
    kube.kubectl(
        "patch", "executorpool", POOL, "-n", NAMESPACE, "--type=merge",
        "-p", json.dumps({"spec": {"admission": {"replicas": 1}}}),
    )  # fmt: skip
    wait_for(lambda: len(_admission_pods(kube)) == 1, "back to one admission pod", timeout_s=120)
    wait_for(lambda: pool_ready(kube, 2), "the pool Ready on one admission replica")


def test_helm_upgrade_and_rollback(
    kube: KubeCluster,
    cluster_helm: ClusterHelm,
    release: Path,
    cluster_images: ClusterImages,
    kafka_bootstrap: str,
    topics: dict[str, str],
    tmp_path: Path,
) -> None:
    before = get_json(kube, "deployment", "kvgate-operator", "-n", NAMESPACE)
    values = chart_values(cluster_images, verbose=True, podAnnotations={"kvgate.test/upgrade": "2"})
    cluster_helm.run(
        "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(write_values(tmp_path, values)),
        "--wait", "--timeout", "240s", timeout_s=300,
    )  # fmt: skip
    after = get_json(kube, "deployment", "kvgate-operator", "-n", NAMESPACE)
    assert after["metadata"]["generation"] > before["metadata"]["generation"]
    template = after["spec"]["template"]
    assert template["metadata"]["annotations"]["kvgate.test/upgrade"] == "2"
    assert "--verbose" in json.dumps(template["spec"]["containers"][0])
    history = cluster_helm.run("history", RELEASE, "-n", NAMESPACE, "-o", "json").stdout
    assert [entry["revision"] for entry in json.loads(history)] == [1, 2]
    # The upgraded operator still reconciles and the pool still serves.
    before_count = len(collect(kafka_bootstrap, topics, 0, timeout_s=30))
    requests = text_requests(4)
    run_requests(kafka_bootstrap, topics, requests)
    results = collect(kafka_bootstrap, topics, before_count + len(requests))
    ids = {request["request_id"] for request in requests}
    answered_once([r for r in results if r.request_id in ids], requests)
    # And back: a rollback restores revision 1's operator as revision 3.
    cluster_helm.run(
        "rollback", RELEASE, "1", "-n", NAMESPACE, "--wait", "--timeout", "240s", timeout_s=300
    )
    rolled = get_json(kube, "deployment", "kvgate-operator", "-n", NAMESPACE)
    annotations = rolled["spec"]["template"]["metadata"].get("annotations", {})
    assert "kvgate.test/upgrade" not in annotations
    assert "--verbose" not in json.dumps(rolled["spec"]["template"]["spec"]["containers"][0])
    history = json.loads(cluster_helm.run("history", RELEASE, "-n", NAMESPACE, "-o", "json").stdout)
    assert [(entry["revision"], entry["status"]) for entry in history][-1] == (3, "deployed")
    wait_for(lambda: pool_ready(kube, 2), "the pool Ready under the rolled-back operator")


def test_invalid_values_and_pools_are_refused(
    kube: KubeCluster,
    cluster_helm: ClusterHelm,
    release: Path,
    cluster_images: ClusterImages,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    # Values the chart's schema refuses: the upgrade fails, naming the value, changing nothing.
    values = chart_values(cluster_images)
    values["images"]["pullPolicy"] = "Sometimes"
    failed = cluster_helm.run(
        "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(write_values(tmp_path, values)),
        check=False,
    )  # fmt: skip
    assert failed.returncode != 0
    assert "pullPolicy" in failed.stderr, failed.stderr
    history = json.loads(cluster_helm.run("history", RELEASE, "-n", NAMESPACE, "-o", "json").stdout)
    assert history[-1]["status"] == "deployed"
    # A pool the CRD's schema refuses never reaches the operator.
    topics = {"requests": "bad.requests", "results": "bad.results"}
    bad = pool_manifest(cluster_images, kafka_bootstrap, topics, replicas=-1)
    bad["metadata"]["name"] = "bad-schema"
    refused = kube.kubectl("apply", "-f", "-", input_text=json.dumps(bad), check=False)
    assert refused.returncode != 0
    assert "spec.replicas" in refused.stderr, refused.stderr
    # A pool the schema accepts but the operator cannot run: InvalidSpec, and no children.
    bad = pool_manifest(cluster_images, kafka_bootstrap, topics)
    bad["metadata"]["name"] = "bad-spec"
    bad["spec"]["model"]["loops"] = 4  # llama runs its layers once
    kube.kubectl("apply", "-f", "-", input_text=json.dumps(bad))

    def invalid() -> str:
        status = get_json(kube, "executorpool", "bad-spec", "-n", NAMESPACE).get("status", {})
        for condition in status.get("conditions", []):
            if condition.get("reason") == "InvalidSpec":
                return str(condition.get("message", ""))
        return ""

    message = wait_for(invalid, "the operator to refuse the pool", timeout_s=60)
    assert "loops" in message, message
    selector = "kvgate.dev/pool=bad-spec"
    assert get_json(kube, "pods", "-n", NAMESPACE, "-l", selector)["items"] == []
    kube.kubectl("delete", "executorpool", "bad-spec", "-n", NAMESPACE)


def test_uninstall_leaves_nothing(
    kube: KubeCluster, cluster_helm: ClusterHelm, release: Path
) -> None:
    """Deleting the pool leaves the controller-manager's garbage collector to remove its
    children (owner references); ``helm uninstall`` then removes the release's own objects.
    Kept on purpose: the CRD (helm never deletes CRDs) and the operator's token-key Secret
    (``helm.sh/resource-policy: keep``)."""
    owned = "pods,services,configmaps,deployments,secrets"
    selector = f"kvgate.dev/pool={POOL}"
    assert get_json(kube, owned, "-n", NAMESPACE, "-l", selector)["items"]
    kube.kubectl("delete", "executorpool", POOL, "-n", NAMESPACE, "--wait=false")
    wait_for(
        lambda: not get_json(kube, owned, "-n", NAMESPACE, "-l", selector)["items"],
        "the garbage collector to remove the pool's children",
        timeout_s=120,
    )
    kube.kubectl("delete", "secret", TOKEN_SECRET, "-n", NAMESPACE)  # the test's own
    cluster_helm.run("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s")
    kinds = (
        "deployments,replicasets,pods,services,configmaps,serviceaccounts,roles,rolebindings,"
        "networkpolicies,poddisruptionbudgets,secrets,executorpools,kopfpeerings.kopf.dev"
    )

    def leftovers() -> list[str]:
        items = get_json(kube, kinds, "-n", NAMESPACE)["items"]
        return [
            f"{item['kind']}/{item['metadata']['name']}"
            for item in items
            if not (item["kind"] == "ConfigMap" and item["metadata"]["name"] == "kube-root-ca.crt")
            and not (item["kind"] == "ServiceAccount" and item["metadata"]["name"] == "default")
        ]

    kept = "Secret/kvgate-operator-token-key"
    deadline = time.monotonic() + 120
    while leftovers() != [kept] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftovers() == [kept]
    crds = get_json(kube, "crd")["items"]
    assert "executorpools.kvgate.dev" in {crd["metadata"]["name"] for crd in crds}
