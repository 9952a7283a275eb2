"""The real operator (``kopf run``) against an API server inside the test.

The test plays the user (creates and edits pools), the kubelet (pods turn Running and Ready, or
fail) and, through the fake admin API, the admission service (executors hold work until the test
releases it). Every wait is for a state, with a deadline; nothing sleeps for a fixed time. After
each test the ``operator`` fixture checks that every API request the operator made is allowed
by ``REQUIRED_RULES``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import yaml
from kopf.testing import KopfRunner

from kvgate.operator.naming import ANNOTATION_DRAINING_SINCE, LABEL_REVISION
from tests.operator.cluster import NAMESPACE, Cluster, deleted_at, operator_writes, pool_manifest

PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
POOL = f"/apis/kvgate.dev/v1alpha1/namespaces/{NAMESPACE}/executorpools/pool"


def endpoints(cluster: Cluster) -> dict[str, str]:
    return {name: m.endpoint for name, m in cluster.admin.members.items()}


def pod_endpoints(cluster: Cluster) -> dict[str, str]:
    return {
        name: f"ws://{pod['status']['podIP']}:8000/v1/steps"
        for name, pod in cluster.pods().items()
        if pod.get("status", {}).get("podIP")
    }


def drained_at(cluster: Cluster, name: str) -> int:
    calls = cluster.admin.calls("POST", f"/v1/executors/{name}/drain")
    assert calls, f"no drain call for {name}"
    return calls[0].seq


async def ready_pool(cluster: Cluster, **spec: Any) -> None:
    await cluster.create(pool_manifest(**spec))
    await cluster.wait_for(cluster.ready)


async def test_create_builds_children_and_reports_ready(
    cluster: Cluster, operator: KopfRunner
) -> None:
    await ready_pool(cluster, replicas=2)

    assert sorted(cluster.pods()) == ["pool-0", "pool-1"]
    for kind, name in [
        ("v1/services", "pool-executors"),
        ("v1/services", "pool-admission"),
        ("v1/configmaps", "pool-admission"),
        ("v1/secrets", "pool-admin-token"),
        ("apps/v1/deployments", "pool-admission"),
    ]:
        child = cluster.api.get(kind, NAMESPACE, name)
        assert child is not None, f"{kind} {name} missing"
        [owner] = child["metadata"]["ownerReferences"]
        assert owner["uid"] == cluster.pool()["metadata"]["uid"] and owner["controller"]
    status = cluster.status()
    assert status["phase"] == "Ready"
    assert status["observedGeneration"] == cluster.pool()["metadata"]["generation"]
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (2, 2, 2)
    assert {e["name"]: e["endpoint"] for e in status["executors"]} == pod_endpoints(cluster)
    # The admission service was told about exactly the ready executors, with the admin token.
    assert endpoints(cluster) == pod_endpoints(cluster)
    await cluster.wait_for(lambda: len(cluster.events("ExecutorCreated")) == 2)
    assert "finalizers" not in cluster.pool()["metadata"]


async def test_scale_up_adds_executors_to_membership(
    cluster: Cluster, operator: KopfRunner
) -> None:
    await ready_pool(cluster, replicas=1)
    await cluster.patch_spec("pool", {"replicas": 3})
    await cluster.wait_for(lambda: len(cluster.admin.members) == 3 and cluster.ready())
    assert sorted(cluster.pods()) == ["pool-0", "pool-1", "pool-2"]
    assert endpoints(cluster) == pod_endpoints(cluster)
    assert cluster.status()["readyReplicas"] == 3
    assert not cluster.admin.calls("POST")  # growing drains nothing


async def test_scale_down_drains_before_deleting(cluster: Cluster, operator: KopfRunner) -> None:
    await ready_pool(cluster, replicas=3)
    cluster.admin.set_running("pool-2", 2)  # pool-2 is serving two requests
    await cluster.patch_spec("pool", {"replicas": 2})

    await cluster.wait_for(lambda: cluster.admin.calls("POST", "/v1/executors/pool-2/drain"))
    await cluster.wait_for(lambda: cluster.condition("Draining").get("status") == "True")
    # While it still holds work, the executor stays, marked and reported as draining.
    assert "pool-2" in cluster.pods()
    assert ANNOTATION_DRAINING_SINCE in cluster.pods()["pool-2"]["metadata"]["annotations"]
    [entry] = [e for e in cluster.status()["executors"] if e["name"] == "pool-2"]
    assert entry["draining"] is True
    assert cluster.admin.members["pool-2"].state == "draining"

    cluster.admin.set_running("pool-2", 0)  # its work is done (or moved elsewhere)
    await cluster.wait_for(lambda: "pool-2" not in cluster.pods() and cluster.ready())
    assert drained_at(cluster, "pool-2") < deleted_at(cluster, "pool-2")
    # It left the membership before its pod was deleted.
    last_put = cluster.admin.calls("PUT", "/v1/executors")[-1]
    assert last_put.seq < deleted_at(cluster, "pool-2")
    assert [e["name"] for e in last_put.body["executors"]] == ["pool-0", "pool-1"]
    assert sorted(cluster.pods()) == ["pool-0", "pool-1"]
    assert cluster.condition("Draining")["reason"] == "Drained"
    assert [name for _, name in operator_writes(cluster, "DELETE", "pods")] == ["pool-2"]


async def test_deleted_pod_is_replaced(cluster: Cluster, operator: KopfRunner) -> None:
    await ready_pool(cluster, replicas=2)
    old = cluster.pods()["pool-1"]
    await cluster.delete(f"{PODS}/pool-1")

    def replaced() -> bool:
        pod = cluster.pods().get("pool-1")
        return (
            pod is not None
            and pod["metadata"]["uid"] != old["metadata"]["uid"]
            and "podIP" in pod.get("status", {})
        )

    await cluster.wait_for(replaced)
    new_endpoint = f"ws://{cluster.pods()['pool-1']['status']['podIP']}:8000/v1/steps"
    await cluster.wait_for(lambda: endpoints(cluster).get("pool-1") == new_endpoint)
    await cluster.wait_for(cluster.ready)
    assert sorted(cluster.pods()) == ["pool-0", "pool-1"]


async def test_failed_pod_is_replaced_without_drain(cluster: Cluster, operator: KopfRunner) -> None:
    await ready_pool(cluster, replicas=2)
    old_uid = cluster.pods()["pool-0"]["metadata"]["uid"]
    await cluster.kubelet.set_status("pool-0", phase="Failed", ready=False, ip="10.9.9.9")

    await cluster.wait_for(
        lambda: (
            cluster.pods().get("pool-0", {}).get("metadata", {}).get("uid") not in (None, old_uid)
        )
    )
    await cluster.wait_for(cluster.ready)
    await cluster.wait_for(lambda: cluster.events("ExecutorStopped"))
    assert cluster.events("ExecutorStopped")[0]["type"] == "Warning"
    assert not cluster.admin.calls("POST")  # a stopped executor has nothing to drain
    assert endpoints(cluster) == pod_endpoints(cluster)


async def test_rolling_update_replaces_one_executor_at_a_time(
    cluster: Cluster, operator: KopfRunner
) -> None:
    await ready_pool(cluster, replicas=3)
    old_revision = cluster.status()["revision"]
    await cluster.patch_spec("pool", {"image": "registry.example/kvgate-executor:2"})

    def updated() -> bool:
        pods = cluster.pods().values()
        return (
            cluster.ready()
            and cluster.status()["revision"] != old_revision
            and all(p["spec"]["containers"][0]["image"].endswith(":2") for p in pods)
        )

    await cluster.wait_for(updated, within_s=30)
    # Highest slot first; each executor drained, deleted and recreated before the next drain.
    order = sorted(
        [(c.seq, "drain", c.path.split("/")[3]) for c in cluster.admin.calls("POST")]
        + [(seq, "delete", name) for seq, name in operator_writes(cluster, "DELETE", "pods")]
        + [
            (seq, "create", name)
            for seq, name in operator_writes(cluster, "POST", "pods")
            if seq > drained_at(cluster, "pool-2")
        ]
    )
    steps = [(action, name) for _, action, name in order]
    assert steps == [
        (action, name)
        for name in ("pool-2", "pool-1", "pool-0")
        for action in ("drain", "delete", "create")
    ]
    labels = {p["metadata"]["labels"][LABEL_REVISION] for p in cluster.pods().values()}
    assert labels == {cluster.status()["revision"]}
    assert endpoints(cluster) == pod_endpoints(cluster)


async def test_invalid_spec_reports_and_creates_nothing(
    cluster: Cluster, operator: KopfRunner
) -> None:
    # Valid for the CRD schema, refused by the operator: a llama model runs its layers once.
    bad = pool_manifest(model={"family": "llama", "path": "/models/llama", "loops": 4})
    await cluster.create(bad)
    await cluster.wait_for(lambda: cluster.condition("Ready").get("reason") == "InvalidSpec")
    await cluster.wait_for(lambda: cluster.events("InvalidSpec"))

    ready = cluster.condition("Ready")
    assert ready["status"] == "False"
    assert "spec.model" in ready["message"] and "loops must be 1" in ready["message"]
    assert cluster.status()["phase"] == "Failed"
    [event] = cluster.events("InvalidSpec")
    assert event["type"] == "Warning" and "loops must be 1" in event["message"]
    for kind in ("v1/pods", "v1/services", "v1/configmaps", "v1/secrets", "apps/v1/deployments"):
        assert cluster.api.live(kind, NAMESPACE) == [], kind
    assert not cluster.admin.journal

    # Fixing the spec is all it takes.
    await cluster.patch_spec("pool", {"model": {"family": "llama", "loops": 1}})
    await cluster.wait_for(cluster.ready)
    assert cluster.status()["observedGeneration"] == cluster.pool()["metadata"]["generation"]


async def test_deleted_pool_takes_its_children(cluster: Cluster, operator: KopfRunner) -> None:
    await ready_pool(cluster, replicas=2)
    assert "finalizers" not in cluster.pool()["metadata"]
    await cluster.delete(POOL)

    kinds = ("v1/pods", "v1/services", "v1/configmaps", "v1/secrets", "apps/v1/deployments")
    await cluster.wait_for(lambda: all(not cluster.api.live(k, NAMESPACE) for k in kinds))
    assert cluster.api.get("kvgate.dev/v1alpha1/executorpools", NAMESPACE, "pool") is None
    # The garbage collector did it: the operator deleted nothing itself.
    assert operator_writes(cluster, "DELETE", "pods") == []


async def test_drain_timeout_removes_the_executor_anyway(
    cluster: Cluster, operator: KopfRunner
) -> None:
    await ready_pool(cluster, replicas=2, drainTimeoutSeconds=1)
    cluster.admin.set_running("pool-1", 5)  # never finishes
    await cluster.patch_spec("pool", {"replicas": 1})

    await cluster.wait_for(lambda: cluster.condition("Draining").get("reason") == "DrainTimeout")
    assert "pool-1" not in cluster.pods()
    assert drained_at(cluster, "pool-1") < deleted_at(cluster, "pool-1")
    assert cluster.condition("Draining")["status"] == "False"
    await cluster.wait_for(lambda: cluster.events("DrainTimeout"))  # Events are posted async
    [event] = cluster.events("DrainTimeout")
    assert event["type"] == "Warning" and "pool-1" in event["message"]
    await cluster.wait_for(cluster.ready)


async def test_membership_waits_for_the_admin_api(cluster: Cluster, operator: KopfRunner) -> None:
    cluster.admin.unavailable = True
    await cluster.create(pool_manifest(replicas=2))
    await cluster.wait_for(
        lambda: (
            cluster.condition("AdmissionSynced").get("reason") == "AdminUnavailable"
            and len(cluster.status().get("executors", [])) == 2
        )
    )
    assert not cluster.ready()
    assert "HTTP 503" in cluster.condition("AdmissionSynced")["message"]

    cluster.admin.unavailable = False  # the admission pod became ready
    await cluster.wait_for(cluster.ready)
    assert endpoints(cluster) == pod_endpoints(cluster)


async def test_restarted_operator_finishes_a_drain(cluster: Cluster) -> None:
    """A drain survives an operator restart: the mark on the pod carries it."""
    args = ["run", "--standalone", "--namespace", NAMESPACE, "-m", "kvgate.operator.handlers"]
    first = KopfRunner(args, timeout=30)
    first.__enter__()
    try:
        await ready_pool(cluster, replicas=2)
        cluster.admin.set_running("pool-1", 1)
        await cluster.patch_spec("pool", {"replicas": 1})
        await cluster.wait_for(lambda: cluster.admin.calls("POST", "/v1/executors/pool-1/drain"))
    finally:
        await asyncio.to_thread(first.__exit__, None, None, None)

    cluster.admin.set_running("pool-1", 0)  # drained while no operator was running
    assert "pool-1" in cluster.pods()
    second = KopfRunner(args, timeout=30)
    second.__enter__()
    try:
        await cluster.wait_for(lambda: "pool-1" not in cluster.pods() and cluster.ready())
    finally:
        await asyncio.to_thread(second.__exit__, None, None, None)
    assert len(cluster.admin.calls("POST", "/v1/executors/pool-1/drain")) == 1


async def test_scheduler_settings_roll_the_admission_service_not_the_executors(
    cluster: Cluster, operator: KopfRunner
) -> None:
    await ready_pool(cluster, replicas=2)
    executors = {name: pod["metadata"]["uid"] for name, pod in cluster.pods().items()}
    deployment = cluster.api.get("apps/v1/deployments", NAMESPACE, "pool-admission")
    assert deployment is not None
    before = deployment["spec"]["template"]["metadata"]["annotations"]

    await cluster.patch_spec("pool", {"scheduler": {"maxNumSeqs": 16, "policy": "fcfs"}})

    def config() -> dict[str, Any]:
        configmap = cluster.api.get("v1/configmaps", NAMESPACE, "pool-admission") or {}
        return dict(yaml.safe_load(configmap.get("data", {}).get("admission.yaml", "{}")))

    await cluster.wait_for(
        lambda: config().get("scheduler") == {"max_num_seqs": 16, "policy": "fcfs"}
    )
    await cluster.wait_for(
        lambda: (
            cluster.status().get("observedGeneration") == cluster.pool()["metadata"]["generation"]
            and cluster.ready()
        )
    )
    deployment = cluster.api.get("apps/v1/deployments", NAMESPACE, "pool-admission")
    assert deployment is not None
    after = deployment["spec"]["template"]["metadata"]["annotations"]
    assert after["kvgate.dev/config-hash"] != before["kvgate.dev/config-hash"]  # it restarts
    # The executors were left alone: same pods, nothing drained.
    assert {name: pod["metadata"]["uid"] for name, pod in cluster.pods().items()} == executors
    assert not cluster.admin.calls("POST")


async def test_a_spec_the_api_server_refuses_is_reported_as_invalid(
    cluster: Cluster, operator: KopfRunner
) -> None:
    def operators_known(plural: str, body: Any) -> str | None:
        if plural != "pods":
            return None
        terms = (
            body.get("spec", {})
            .get("affinity", {})
            .get("nodeAffinity", {})
            .get("requiredDuringSchedulingIgnoredDuringExecution", {})
            .get("nodeSelectorTerms", [])
        )
        for term in terms:
            for expression in term.get("matchExpressions", []):
                if expression.get("operator") not in ("In", "NotIn", "Exists", "DoesNotExist"):
                    return f"Unsupported value: {expression.get('operator')!r}"
        return None

    cluster.api.validators.append(operators_known)
    near = {"matchExpressions": [{"key": "gpu", "operator": "Near", "values": ["h100"]}]}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [near]}
        }
    }
    await cluster.create(pool_manifest(replicas=1, affinity=affinity))

    await cluster.wait_for(lambda: cluster.condition("Ready").get("reason") == "InvalidSpec")
    message = cluster.condition("Ready")["message"]
    assert "the API server refused Pod pool-0" in message and "'Near'" in message
    await cluster.wait_for(lambda: cluster.events("InvalidSpec"))
    assert cluster.pods() == {}
