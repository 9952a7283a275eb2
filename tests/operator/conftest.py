"""Fixtures for the operator tests: the CRD, a cluster to run in, the operator itself."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from kopf.testing import KopfRunner

from kvgate.operator.naming import ADMIN_TOKEN_KEY, admin_token_secret_name
from tests.operator.cluster import NAMESPACE, Cluster, Kubelet
from tests.operator.fake_admin import FakeAdminApi
from tests.operator.kube_emulator import KubeEmulator
from tests.operator.rbac_check import unauthorised_calls

CRD_PATH = (
    Path(__file__).parents[2] / "charts" / "kvgate" / "crds" / "executorpools.kvgate.dev.yaml"
)


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return dict(yaml.safe_load(CRD_PATH.read_text()))


@pytest.fixture
async def kube(crd: dict[str, Any]) -> AsyncIterator[KubeEmulator]:
    """The Kubernetes API, with the ExecutorPool CRD created."""
    async with KubeEmulator() as api, kmock.Server(api):
        async with api.post(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd
        ) as response:
            assert response.status == 200, await response.text()
        yield api


def admin_token(api: KubeEmulator, pool: str) -> str | None:
    """The admin token the operator created for ``pool`` (what its admission pod mounts)."""
    secret = api.get("v1/secrets", NAMESPACE, admin_token_secret_name(pool))
    return None if secret is None else base64.b64decode(secret["data"][ADMIN_TOKEN_KEY]).decode()


@pytest.fixture
async def admin_api(kube: KubeEmulator) -> AsyncIterator[FakeAdminApi]:
    """The admission admin API of the pool named "pool".

    The one place that decides what answers the operator's admin calls. Tests use its ``url``,
    its journal (``calls``), its membership, and two knobs: ``set_running`` (work an executor
    holds) and ``unavailable``. A real ``kvgate admission-service`` process can replace it here
    behind a journaling proxy, given an executor stub that holds work on request.
    """
    admin = FakeAdminApi(
        token=lambda: admin_token(kube, "pool"), sequence=kube.sequence, changed=kube.changed
    )
    await admin.start()
    try:
        yield admin
    finally:
        await admin.stop()


@pytest.fixture
async def cluster(
    kube: KubeEmulator, admin_api: FakeAdminApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Cluster]:
    """API server, admin API and kubelet, and the operator's settings pointing at them."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "test", "cluster": {"server": str(kube.url)}}],
                "users": [{"name": "operator", "user": {"token": "operator-token"}}],
                "contexts": [
                    {
                        "name": "test",
                        "context": {"cluster": "test", "user": "operator", "namespace": NAMESPACE},
                    }
                ],
                "current-context": "test",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    # Pods in the emulator have no reachable IPs: every pool's admin API is the one above.
    monkeypatch.setenv("KVGATE_OPERATOR_ADMIN_URL_TEMPLATE", admin_api.url)
    monkeypatch.setenv("KVGATE_OPERATOR_ADMISSION_IMAGE", "registry.example/kvgate-admission:1")
    monkeypatch.setenv("KVGATE_OPERATOR_POLL_INTERVAL_S", "0.2")
    monkeypatch.setenv("KVGATE_OPERATOR_RESYNC_INTERVAL_S", "2")
    monkeypatch.setenv("KVGATE_OPERATOR_MAX_BACKOFF_S", "1")
    kubelet = Kubelet(kube)
    kubelet.start()
    try:
        yield Cluster(kube, admin_api, kubelet)
    finally:
        await kubelet.stop()


@pytest.fixture
async def operator(cluster: Cluster) -> AsyncIterator[KopfRunner]:
    """The real operator (kopf run), for the duration of the test; checks its RBAC use after."""
    runner = KopfRunner(
        ["run", "--standalone", "--namespace", "default", "-m", "kvgate.operator.handlers"],
        timeout=30,
    )
    runner.__enter__()
    try:
        yield runner
    finally:
        # The operator's loop talks to the emulator in this loop: stop it without blocking.
        await asyncio.to_thread(runner.__exit__, None, None, None)
    assert runner.exit_code == 0, runner.output
    assert unauthorised_calls(cluster.api.journal) == []
