"""Fixtures for the operator tests: the CRD, a cluster to run in, the operator itself."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from kopf.testing import KopfRunner

from tests.operator.cluster import Cluster, Kubelet
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
async def cluster(
    crd: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Cluster]:
    async with KubeEmulator() as api, kmock.Server(api):
        async with api.post(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd
        ) as response:
            assert response.status == 200, await response.text()
        world: Cluster
        admin = FakeAdminApi(
            token=lambda: world.admin_token("pool"), sequence=api.sequence, changed=api.changed
        )
        await admin.start()
        kubelet = Kubelet(api)
        world = Cluster(api, admin, kubelet)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "test", "cluster": {"server": str(api.url)}}],
                    "users": [{"name": "operator", "user": {"token": "operator-token"}}],
                    "contexts": [
                        {
                            "name": "test",
                            "context": {
                                "cluster": "test",
                                "user": "operator",
                                "namespace": "default",
                            },
                        }
                    ],
                    "current-context": "test",
                }
            )
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        # Pods in the emulator have no reachable IPs: every pool's admin API is the fake one.
        monkeypatch.setenv("KVGATE_OPERATOR_ADMIN_URL_TEMPLATE", admin.url)
        monkeypatch.setenv("KVGATE_OPERATOR_ADMISSION_IMAGE", "registry.example/kvgate-admission:1")
        monkeypatch.setenv("KVGATE_OPERATOR_POLL_INTERVAL_S", "0.2")
        monkeypatch.setenv("KVGATE_OPERATOR_RESYNC_INTERVAL_S", "2")
        monkeypatch.setenv("KVGATE_OPERATOR_MAX_BACKOFF_S", "1")
        kubelet.start()
        try:
            yield world
        finally:
            await kubelet.stop()
            await admin.stop()


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
