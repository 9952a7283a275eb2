"""Fixtures for the operator tests: the CRD, a cluster to run in, the operator itself."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from kopf.testing import KopfRunner

from kvgate.local.embedded_broker import EmbeddedBroker
from tests.operator.admin_proxy import JournalingProxy
from tests.operator.cluster import NAMESPACE, Cluster, Kubelet, admin_token
from tests.operator.fake_admin import FakeAdminApi
from tests.operator.kube_emulator import KubeEmulator
from tests.operator.pod_processes import AdmissionPod, ProcessKubelet
from tests.operator.rbac_check import unauthorised_calls

CRD_PATH = (
    Path(__file__).parents[2] / "charts" / "kvgate" / "crds" / "executorpools.kvgate.dev.yaml"
)


# The key the operator derives per-pool admin tokens from (the chart mounts one from a Secret).
TOKEN_KEY = "operator-token-key-for-the-tests-0123456789abcdef"


@pytest.fixture(autouse=True)
def operator_token_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv("KVGATE_OPERATOR_TOKEN_KEY_FILE", raising=False)
    monkeypatch.setenv("KVGATE_OPERATOR_TOKEN_KEY", TOKEN_KEY)
    return TOKEN_KEY


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


@pytest.fixture
async def admin_api(kube: KubeEmulator) -> AsyncIterator[FakeAdminApi]:
    """The admission admin API of the pool named "pool".

    The one place that decides what answers the operator's admin calls. Tests use its ``url``,
    its journal (``calls``), its membership, and two knobs: ``set_running`` (work an executor
    holds) and ``unavailable``. ``service_cluster`` below has a real admission service instead.
    """
    admin = FakeAdminApi(
        token=lambda: admin_token(kube, "pool"), sequence=kube.sequence, changed=kube.changed
    )
    await admin.start()
    try:
        yield admin
    finally:
        await admin.stop()


def point_operator_at(
    kube: KubeEmulator, admin_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator's settings: the emulated API server, ``admin_url`` for every pool's admin
    API (pods in the emulator have no reachable Service), short intervals."""
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
    monkeypatch.setenv("KVGATE_OPERATOR_ADMIN_URL_TEMPLATE", admin_url)
    monkeypatch.setenv("KVGATE_OPERATOR_ADMISSION_IMAGE", "registry.example/kvgate-admission:1")
    monkeypatch.setenv("KVGATE_OPERATOR_POLL_INTERVAL_S", "0.2")
    monkeypatch.setenv("KVGATE_OPERATOR_RESYNC_INTERVAL_S", "2")
    monkeypatch.setenv("KVGATE_OPERATOR_MAX_BACKOFF_S", "1")


@pytest.fixture
async def cluster(
    kube: KubeEmulator, admin_api: FakeAdminApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Cluster[FakeAdminApi]]:
    """API server, fake admin API and kubelet, and the operator's settings pointing at them."""
    point_operator_at(kube, admin_api.url, tmp_path, monkeypatch)
    kubelet = Kubelet(kube)
    kubelet.start()
    try:
        yield Cluster(kube, admin_api, kubelet)
    finally:
        await kubelet.stop()


# --- a real admission service ------------------------------------------------------------------

EXECUTOR_TOKEN = "executor-token-for-tests"
# Each executor step takes this long (emulated compute): requests stay on an executor long
# enough for a drain to find them there.
SIM_EXECUTOR_ARGS = ["--step-time-ms", "40", "--num-blocks", "128", "--block-size", "16"]
# Settings of the test's admission pod beyond the operator's ConfigMap: the group timings the
# embedded broker needs (it answers a JoinGroup after about half the session timeout), no
# transactions (it has none), quick reconnects and a short shutdown.
SERVICE_OVERRIDES = {
    "KVGATE_KAFKA__SESSION_TIMEOUT_MS": "2000",
    "KVGATE_KAFKA__HEARTBEAT_INTERVAL_MS": "500",
    "KVGATE_KAFKA__COMMIT_INTERVAL_MS": "50",
    "KVGATE_KAFKA__PARTITIONS": "2",
    "KVGATE_KAFKA__EXACTLY_ONCE": "off",
    "KVGATE_EXECUTORS__RECONNECT_INITIAL_S": "0.1",
    "KVGATE_EXECUTORS__RECONNECT_MAX_S": "1",
    "KVGATE_SHUTDOWN__GRACE_PERIOD_S": "1",
}


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    """The embedded Kafka-compatible broker (Tansu), shared by the real-service tests."""
    with EmbeddedBroker() as running:
        yield running


@pytest.fixture
async def service_cluster(
    kube: KubeEmulator, broker: EmbeddedBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Cluster[JournalingProxy]]:
    """API server, a real ``kvgate admission-service`` behind a journaling proxy (started from
    the operator's own Deployment and ConfigMap once they exist), and a kubelet whose executor
    pods are real ``kvgate sim-executor`` processes."""
    async with kube.post(
        f"/api/v1/namespaces/{NAMESPACE}/secrets",
        json={
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "executor-token", "namespace": NAMESPACE},
            "stringData": {"token": EXECUTOR_TOKEN},
        },
    ) as response:
        assert response.status == 200, await response.text()
    proxy = JournalingProxy(sequence=kube.sequence, changed=kube.changed)
    await proxy.start()
    point_operator_at(kube, proxy.url, tmp_path, monkeypatch)
    admission = AdmissionPod(kube, proxy, tmp_path, overrides=SERVICE_OVERRIDES)
    kubelet = ProcessKubelet(kube, log_dir=tmp_path, executor_args=SIM_EXECUTOR_ARGS)
    admission.start()
    kubelet.start()
    try:
        yield Cluster(kube, proxy, kubelet)
    finally:
        await admission.stop()
        await kubelet.stop()
        await proxy.stop()
    assert kubelet.failures == []
    assert admission.error is None, repr(admission.error)
    if admission.child is not None:
        assert admission.child.process.returncode == 0, admission.child.log_tail()


@pytest.fixture
async def operator(cluster: Cluster[Any]) -> AsyncIterator[KopfRunner]:
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
