"""One reconcile pass at a time, without kopf: idempotence, conflicts, repairs."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf
import pytest

from kvgate.operator.admin import AdminRejected
from kvgate.operator.config import OperatorConfig
from kvgate.operator.kube import KubeApi
from kvgate.operator.naming import GROUP, PLURAL, VERSION
from kvgate.operator.reconciler import OutcomeKind, Reconciler
from tests.operator.cluster import MERGE, NAMESPACE, Cluster, pool_manifest
from tests.operator.conftest import TOKEN_KEY
from tests.operator.fake_admin import FakeAdminApi
from tests.operator.kube_emulator import KubeEmulator


@dataclass
class Events:
    posted: list[tuple[str, str, str]] = field(default_factory=list)

    def __call__(self, obj: dict[str, Any], *, type: str, reason: str, message: str) -> None:
        self.posted.append((type, reason, message))


@dataclass
class Harness:
    reconciler: Reconciler
    events: Events
    cluster: Cluster

    async def run(self) -> OutcomeKind:
        return (await self.reconciler.reconcile(NAMESPACE, "pool")).kind

    def writes(self) -> list[str]:
        return [
            f"{c.method} {c.plural}/{c.name}"
            for c in self.cluster.api.journal
            if c.user_agent == "kvgate-operator" and c.method != "GET"
        ]


@pytest.fixture
async def harness(
    cluster: Cluster, kube: KubeEmulator, admin_api: FakeAdminApi
) -> AsyncIterator[Harness]:
    config = OperatorConfig(
        admin_url_template=admin_api.url, admission_image="registry.example/adm:1"
    )

    async def login() -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=str(kube.url))

    kube_api = KubeApi(login, timeout_s=5)
    async with aiohttp.ClientSession() as session:
        events = Events()
        try:
            yield Harness(Reconciler(kube_api, session, config, events), events, cluster)
        finally:
            await kube_api.close()


async def converge(harness: Harness) -> None:
    for _ in range(10):
        if await harness.run() is OutcomeKind.CONVERGED:
            return
        await harness.cluster.wait_for(lambda: not harness.cluster.kubelet.pending())
    raise AssertionError("no convergence in 10 passes")


async def test_a_pass_over_a_converged_pool_writes_nothing(harness: Harness) -> None:
    await harness.cluster.create(pool_manifest(replicas=2))
    await converge(harness)
    before = len(harness.writes())
    assert await harness.run() is OutcomeKind.CONVERGED
    assert harness.writes()[before:] == []  # no status rewrite, no patch of any child


async def test_a_gone_pool_is_left_to_the_garbage_collector(harness: Harness) -> None:
    assert await harness.run() is OutcomeKind.GONE
    assert harness.writes() == []


async def test_a_foreign_object_in_the_way_is_not_taken_over(harness: Harness) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "pool-admission", "namespace": NAMESPACE},
        "spec": {"ports": [{"port": 80}]},
    }
    async with harness.cluster.api.post(f"/api/v1/namespaces/{NAMESPACE}/services", json=service):
        pass
    await harness.cluster.create(pool_manifest(replicas=1))
    assert await harness.run() is OutcomeKind.WAITING
    ready = harness.cluster.condition("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NameConflict")
    assert "Service pool-admission exists and does not belong to this pool" in ready["message"]
    live = harness.cluster.api.get("v1/services", NAMESPACE, "pool-admission")
    assert live is not None and live["spec"]["ports"] == [{"port": 80}]
    assert harness.cluster.pods() == {}


async def test_the_admin_token_is_derived_and_no_secret_is_ever_read(harness: Harness) -> None:
    """The token in the pool's Secret is HMAC(operator key, namespace/name/uid), computed here
    independently; the operator only creates that Secret, once, and reads none."""
    await harness.cluster.create(pool_manifest(replicas=1))
    await converge(harness)
    await converge(harness)  # a second pass writes nothing new
    secret = harness.cluster.api.get("v1/secrets", NAMESPACE, "pool-admin-token")
    pool = harness.cluster.api.get(f"{GROUP}/{VERSION}/{PLURAL}", NAMESPACE, "pool")
    assert secret is not None and pool is not None
    message = b"\0".join(
        (b"kvgate-admin-token", NAMESPACE.encode(), b"pool", pool["metadata"]["uid"].encode())
    )
    digest = hmac.new(TOKEN_KEY.encode(), message, hashlib.sha256).digest()
    expected = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    assert base64.b64decode(secret["data"]["token"]).decode() == expected
    secret_calls = [
        (c.method, c.name)
        for c in harness.cluster.api.journal
        if c.user_agent == "kvgate-operator" and c.plural == "secrets"
    ]
    assert secret_calls in ([("POST", None)], [("POST", "pool-admin-token")])


async def test_a_foreign_admin_token_secret_is_reported_with_the_way_out(
    harness: Harness, admin_api: FakeAdminApi
) -> None:
    """A Secret of that name made by hand holds another token: the operator cannot read or fix
    it, so the admin API refuses the operator and the pool's status says to delete the Secret."""
    foreign = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "pool-admin-token", "namespace": NAMESPACE},
        "data": {"token": base64.b64encode(b"made-by-hand").decode()},
    }
    async with harness.cluster.api.post(
        f"/api/v1/namespaces/{NAMESPACE}/secrets", json=foreign
    ) as response:
        assert response.status == 200, await response.text()
    await harness.cluster.create(pool_manifest(replicas=1))
    refused: AdminRejected | None = None
    for _ in range(10):  # passes until the admin API has been asked (pods started meanwhile)
        try:
            assert await harness.run() is not OutcomeKind.CONVERGED
        except AdminRejected as error:  # kopf retries it and posts it as the pass's failure
            refused = error
            break
        await harness.cluster.wait_for(lambda: not harness.cluster.kubelet.pending())
    assert any(call.status == 401 for call in admin_api.journal)
    assert refused is not None and "delete it and the operator writes it again" in str(refused)


async def test_an_edited_child_is_put_back(harness: Harness) -> None:
    await harness.cluster.create(pool_manifest(replicas=1))
    await converge(harness)
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/pool-admission"
    for edit in (
        {"spec": {"replicas": 3}},  # kubectl scale: the hash annotation is untouched
        {"metadata": {"annotations": {"kvgate.dev/spec-hash": "edited"}}},
    ):
        async with harness.cluster.api.patch(path, json=edit, headers=MERGE):
            pass
        await converge(harness)
        deployment = harness.cluster.api.get("apps/v1/deployments", NAMESPACE, "pool-admission")
        assert deployment is not None and deployment["spec"]["replicas"] == 1
        assert deployment["metadata"]["annotations"]["kvgate.dev/spec-hash"] != "edited"
    # What the API server or others add is left alone.
    added = {"metadata": {"labels": {"team": "x"}}, "spec": {"revisionHistoryLimit": 10}}
    async with harness.cluster.api.patch(path, json=added, headers=MERGE):
        pass
    before = len(harness.writes())
    assert await harness.run() is OutcomeKind.CONVERGED
    assert harness.writes()[before:] == []


async def test_events_tell_what_happened(harness: Harness) -> None:
    await harness.cluster.create(pool_manifest(replicas=1))
    await converge(harness)
    reasons = [reason for _, reason, _ in harness.events.posted]
    assert reasons == ["ExecutorCreated", "MembershipUpdated"]
