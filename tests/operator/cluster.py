"""The world an operator behaviour test runs in: an API server, a kubelet, an admission service.

``Cluster`` bundles the Kubernetes emulator (``kube_emulator``), the admin API the operator
calls (the fake one in ``fake_admin``, or the proxy in front of a real admission service in
``admin_proxy``) and a ``Kubelet`` that plays the node: it gives new pods an IP and marks them
Running and Ready, unless a test takes a pod over to fail it or hold it back
(``pod_processes.ProcessKubelet`` runs each executor pod as a process instead).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvgate.operator.naming import ADMIN_TOKEN_KEY, admin_token_secret_name
from tests.operator.kube_emulator import KubeEmulator, until

NAMESPACE = "default"
POOLS = "kvgate.dev/v1alpha1/executorpools"
MERGE = {"Content-Type": "application/merge-patch+json"}
AdminT = TypeVar("AdminT")


def pool_manifest(name: str = "pool", **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "replicas": 2,
        "image": "registry.example/kvgate-executor:1",
        "model": {"family": "looped", "path": "/models/ouro", "loops": 4},
        "kafka": {"bootstrapServers": "kafka-0.kafka:9092"},
        "tokenSecret": {"name": "executor-token"},
        "drainTimeoutSeconds": 60,
    }
    base.update(spec)
    return {
        "apiVersion": "kvgate.dev/v1alpha1",
        "kind": "ExecutorPool",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": base,
    }


@dataclass
class Kubelet:
    """Plays the kubelet: new pods get an IP and turn Running and Ready (unless held)."""

    api: KubeEmulator
    held: set[str] = field(default_factory=set)  # pods the kubelet leaves alone
    _next_ip: int = 10
    _task: asyncio.Task[None] | None = None

    def pending(self) -> list[dict[str, Any]]:
        return [
            pod
            for pod in self.api.live("v1/pods", NAMESPACE)
            if "phase" not in (pod.get("status") or {}) and pod["metadata"]["name"] not in self.held
        ]

    async def set_status(self, name: str, *, phase: str, ready: bool, ip: str | None) -> bool:
        """Write a pod's status; False when the pod was deleted meanwhile (a real kubelet
        sees that too, when a scale-down removes a pod that is still starting)."""
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        }
        if ip is not None:
            status["podIP"] = ip
        path = f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/status"
        async with self.api.patch(path, json={"status": status}, headers=MERGE) as response:
            if response.status == 404:
                return False
            assert response.status == 200, await response.text()
        return True

    async def start_pod(self, name: str) -> str:
        self._next_ip += 1
        ip = f"10.1.0.{self._next_ip}"
        await self.set_status(name, phase="Running", ready=True, ip=ip)
        return ip

    async def _run(self) -> None:
        while True:
            async with self.api.changed:
                await self.api.changed.wait_for(lambda: bool(self.pending()))
            for pod in self.pending():
                await self.start_pod(pod["metadata"]["name"])

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@dataclass
class Cluster(Generic[AdminT]):
    api: KubeEmulator
    admin: AdminT  # FakeAdminApi or JournalingProxy: journal, calls()
    kubelet: Kubelet

    # --- the user's side ----------------------------------------------------------------------

    async def create(self, manifest: dict[str, Any]) -> None:
        path = f"/apis/kvgate.dev/v1alpha1/namespaces/{NAMESPACE}/executorpools"
        async with self.api.post(path, json=copy.deepcopy(manifest)) as response:
            assert response.status == 200, await response.text()

    async def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        path = f"/apis/kvgate.dev/v1alpha1/namespaces/{NAMESPACE}/executorpools/{name}"
        async with self.api.patch(path, json={"spec": spec}, headers=MERGE) as response:
            assert response.status == 200, await response.text()

    async def delete(self, resource_path: str) -> None:
        async with self.api.delete(resource_path) as response:
            assert response.status == 200, await response.text()

    # --- reading the state ----------------------------------------------------------------------

    def pool(self, name: str = "pool") -> dict[str, Any]:
        pool = self.api.get(POOLS, NAMESPACE, name)
        assert pool is not None
        return pool

    def status(self, name: str = "pool") -> dict[str, Any]:
        return self.pool(name).get("status") or {}

    def condition(self, type_: str, name: str = "pool") -> dict[str, Any]:
        for condition in self.status(name).get("conditions", []):
            if condition["type"] == type_:
                return dict(condition)
        return {}

    def pods(self) -> dict[str, dict[str, Any]]:
        return {p["metadata"]["name"]: p for p in self.api.live("v1/pods", NAMESPACE)}

    def events(self, reason: str, name: str = "pool") -> list[dict[str, Any]]:
        return [
            e
            for e in self.api.live("v1/events", NAMESPACE)
            if e["reason"] == reason and e["involvedObject"]["name"] == name
        ]

    def ready(self, name: str = "pool") -> bool:
        return self.condition("Ready", name).get("status") == "True"

    async def wait_for(self, predicate: Callable[[], object], within_s: float = 15.0) -> None:
        """Until ``predicate()`` holds; re-checked after every API write or admin call."""
        await until(self.api.changed, predicate, within_s=within_s)


def admin_token(api: KubeEmulator, pool: str) -> str | None:
    """The admin token the operator created for ``pool`` (what its admission pod mounts)."""
    secret = api.get("v1/secrets", NAMESPACE, admin_token_secret_name(pool))
    return None if secret is None else base64.b64decode(secret["data"][ADMIN_TOKEN_KEY]).decode()


def operator_writes(cluster: Cluster, method: str, plural: str) -> list[tuple[int, str | None]]:
    """(sequence number, name) of the operator's requests of one kind, in order."""
    return [
        (call.seq, call.name)
        for call in cluster.api.journal
        if call.method == method
        and call.plural == plural
        and not call.user_agent.startswith("kmock/")
        and call.status < 400
    ]


def deleted_at(cluster: Cluster, name: str) -> int:
    seqs = [seq for seq, pod in operator_writes(cluster, "DELETE", "pods") if pod == name]
    assert seqs, f"{name} was not deleted by the operator"
    return seqs[0]
