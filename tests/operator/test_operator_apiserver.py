"""The real operator against a real kube-apiserver (``tests/harness/kube_apiserver.py``).

What the emulator in ``kube_emulator.py`` cannot show: the CRD's openAPI schema is enforced by
the API server, status lives in its own subresource, ``metadata.generation`` moves only with
the spec, the scale subresource works, and the operator does its job under exactly the RBAC
the chart renders (a Role bound to the operator's ServiceAccount; the operator authenticates
as that account). There is no kubelet: the test patches pod status the way a kubelet would.
The admin API the operator calls is ``FakeAdminApi``, as in the other behaviour tests.

The apiserver is built from Go modules on first use (``make test`` builds it; see
docs/testing.md) and started once for this module.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import kopf
import pytest
import yaml
from kopf.testing import KopfRunner

from kvgate.operator.kube import PODS as PODS_RESOURCE
from kvgate.operator.kube import ApiError, KubeApi, default_login
from kvgate.operator.naming import ADMIN_TOKEN_KEY, admin_token_secret_name
from kvgate.protocol.admin import QueueLoad
from tests.chart.helm import Helm
from tests.chart.manifests import render
from tests.chart.value_sets import ValueSet
from tests.harness.go_build import GoMissing
from tests.harness.kube_apiserver import KubeApiServer, build
from tests.harness.system import wait_until
from tests.operator.cluster import NAMESPACE, pool_manifest
from tests.operator.fake_admin import FakeAdminApi

pytestmark = pytest.mark.kube_apiserver

T = TypeVar("T")
CRD_PATH = (
    Path(__file__).parents[2] / "charts" / "kvgate" / "crds" / "executorpools.kvgate.dev.yaml"
)
MERGE = "application/merge-patch+json"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
POOLS = f"/apis/kvgate.dev/v1alpha1/namespaces/{NAMESPACE}/executorpools"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
# The chart as installed for an operator that watches one namespace without peering (the
# operator below runs --standalone): its Role and RoleBinding are applied unchanged.
CHART_VALUES = ValueSet(
    "apiserver-tests",
    namespace=NAMESPACE,
    values={"operator": {"peering": {"enabled": False}}},
)


# --- the cluster ---------------------------------------------------------------------------------


def _ok(answer: tuple[int, Any]) -> Any:
    """The body of a successful answer (200 or 201); fails the test with the Status otherwise."""
    status, body = answer
    assert status in (200, 201), body
    return body


@pytest.fixture(scope="module")
def chart_rbac(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The chart's Role and RoleBinding for the operator in ``NAMESPACE``."""
    helm = Helm.create(tmp_path_factory.mktemp("helm-home"))
    rendered = render(helm, CHART_VALUES, tmp_path_factory.mktemp("chart-values"))
    documents = rendered.of_kind("Role") + rendered.of_kind("RoleBinding")
    assert [d["kind"] for d in documents] == ["Role", "RoleBinding"], documents
    assert not rendered.of_kind("ClusterRole")
    return documents


def _wait_established(server: KubeApiServer, name: str) -> None:
    def established() -> bool:
        status, crd = server.request("GET", f"{CRDS}/{name}")
        assert status == 200, crd
        conditions = (crd.get("status") or {}).get("conditions") or []  # null at first
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_until(established, timeout_s=30, what=f"CRD {name} to be established")


@pytest.fixture(scope="module")
def apiserver(chart_rbac: list[dict[str, Any]]) -> Iterator[KubeApiServer]:
    """A running apiserver with the chart's CRD and the operator's Role and RoleBinding."""
    try:
        binary = build()
    except GoMissing as exc:
        pytest.skip(str(exc))
    [subject] = chart_rbac[1]["subjects"]
    assert subject["kind"] == "ServiceAccount", subject
    with KubeApiServer(binary, operator_user=f"{subject['namespace']}/{subject['name']}") as server:
        crd = yaml.safe_load(CRD_PATH.read_text())
        _ok(server.request("POST", CRDS, crd))
        _wait_established(server, crd["metadata"]["name"])
        role, binding = chart_rbac
        rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}"
        _ok(server.request("POST", f"{rbac}/roles", role))
        _ok(server.request("POST", f"{rbac}/rolebindings", binding))
        yield server


async def call(
    server: KubeApiServer, method: str, path: str, body: Any = None, **kwargs: Any
) -> tuple[int, Any]:
    """``server.request`` off the event loop (the fake admin API shares this loop)."""
    return await asyncio.to_thread(server.request, method, path, body, **kwargs)


async def eventually(
    probe: Callable[[], Awaitable[T | None]], what: str, within_s: float = 20.0
) -> T:
    """Poll ``probe`` until it returns something other than None (or False); fail after
    ``within_s`` naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        result = await probe()
        if result is not None and result is not False:
            return result
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.1)


async def get(server: KubeApiServer, path: str) -> dict[str, Any] | None:
    status, body = await call(server, "GET", path)
    if status == 404:
        return None
    assert status == 200, body
    return dict(body)


async def play_kubelet(server: KubeApiServer, pod: str, ip: str) -> None:
    """What a kubelet reports for a started, ready container."""
    status = {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    answer = await call(
        server, "PATCH", f"{PODS}/{pod}/status", {"status": status}, content_type=MERGE
    )
    _ok(answer)


# --- the operator --------------------------------------------------------------------------------


@dataclass
class AdminToken:
    """The valid admin token: the one in the Secret the operator created for ``pool``. Read
    when an admin request arrives (a short blocking call to the local apiserver)."""

    apiserver: KubeApiServer
    pool: str | None = None

    def __call__(self) -> str | None:
        if self.pool is None:
            return None
        path = f"/api/v1/namespaces/{NAMESPACE}/secrets/{admin_token_secret_name(self.pool)}"
        status, secret = self.apiserver.request("GET", path)
        if status != 200:
            return None
        return base64.b64decode(secret["data"][ADMIN_TOKEN_KEY]).decode()


@pytest.fixture
def admin_token(apiserver: KubeApiServer) -> AdminToken:
    return AdminToken(apiserver)


@pytest.fixture
async def admin_api(admin_token: AdminToken) -> AsyncIterator[FakeAdminApi]:
    """The admin API the operator calls for every pool (one pool per test)."""
    admin = FakeAdminApi(token=admin_token)
    await admin.start()
    try:
        yield admin
    finally:
        await admin.stop()


@pytest.fixture
async def operator(
    apiserver: KubeApiServer,
    admin_api: FakeAdminApi,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[KopfRunner]:
    """``kopf run`` as the operator's ServiceAccount; after the test, its log has no 403."""
    kubeconfig = apiserver.kubeconfig(tmp_path / "kubeconfig", token=apiserver.operator_token)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("KVGATE_OPERATOR_ADMIN_URL_TEMPLATE", admin_api.url)
    monkeypatch.setenv("KVGATE_OPERATOR_ADMISSION_IMAGE", "registry.example/kvgate-admission:1")
    monkeypatch.setenv("KVGATE_OPERATOR_POLL_INTERVAL_S", "0.2")
    monkeypatch.setenv("KVGATE_OPERATOR_RESYNC_INTERVAL_S", "2")
    monkeypatch.setenv("KVGATE_OPERATOR_MAX_BACKOFF_S", "1")
    runner = KopfRunner(
        ["run", "--standalone", "--namespace", NAMESPACE, "-m", "kvgate.operator.handlers"],
        timeout=30,
    )
    runner.__enter__()
    try:
        yield runner
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
    assert runner.exit_code == 0, runner.output
    # Each line's leading "[date time,millis]" goes first: its milliseconds may read 403.
    messages = [re.sub(r"^\[[^\]]*\]", "", line) for line in runner.output.splitlines()]
    denials = [m for m in messages if re.search(r"\b403\b|[Ff]orbidden", m)]
    assert not denials, runner.output


@dataclass
class Pools:
    """The user's side: pools created by a test are deleted after it, while its operator
    still runs, so the next test's operator does not find them (no garbage collector deletes
    their children; nothing watches those)."""

    apiserver: KubeApiServer
    admin_token: AdminToken
    created: list[str] = field(default_factory=list)
    _ips: Iterator[int] = field(default_factory=lambda: itertools.count(10))

    async def create(self, name: str, replicas: int, **spec: Any) -> dict[str, Any]:
        self.admin_token.pool = name
        self.created.append(name)
        manifest = pool_manifest(name, replicas=replicas, **spec)
        return dict(_ok(await call(self.apiserver, "POST", POOLS, manifest)))

    async def start_pods(self, names: list[str]) -> None:
        """Wait for the operator to create ``names``, then play their kubelet."""
        for name in names:
            path = f"{PODS}/{name}"
            await eventually(lambda path=path: get(self.apiserver, path), f"pod {name}")
            await play_kubelet(self.apiserver, name, f"10.1.0.{next(self._ips)}")

    async def delete_all(self) -> None:
        for name in self.created:
            status, answer = await call(self.apiserver, "DELETE", f"{POOLS}/{name}")
            assert status in (200, 202, 404), answer
            path = f"{POOLS}/{name}"
            await eventually(lambda path=path: self._gone(path), f"pool {name} to be deleted")

    async def _gone(self, path: str) -> bool:
        return await get(self.apiserver, path) is None


@pytest.fixture
async def pools(
    apiserver: KubeApiServer, admin_token: AdminToken, operator: KopfRunner
) -> AsyncIterator[Pools]:
    created = Pools(apiserver, admin_token)
    yield created
    await created.delete_all()


async def pool_status(apiserver: KubeApiServer, name: str, **expected: Any) -> dict[str, Any]:
    """The pool once its status has ``expected`` and reports its current generation."""

    async def probe() -> dict[str, Any] | None:
        pool = await get(apiserver, f"{POOLS}/{name}")
        assert pool is not None
        status = pool.get("status") or {}
        matches = all(status.get(key) == value for key, value in expected.items())
        current = status.get("observedGeneration") == pool["metadata"]["generation"]
        return pool if matches and current else None

    return await eventually(probe, f"pool {name} status {expected}")


async def executor_events(apiserver: KubeApiServer, pool: str, count: int) -> bool:
    events = await get(apiserver, f"/api/v1/namespaces/{NAMESPACE}/events")
    assert events is not None
    created = [
        e
        for e in events["items"]
        if e["reason"] == "ExecutorCreated" and e["involvedObject"]["name"] == pool
    ]
    return len(created) == count


# --- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "field", "reason"),
    [
        ({"replicas": -1}, "spec.replicas", "should be greater than or equal to 0"),
        ({"imagePullPolicy": "Sometimes"}, "spec.imagePullPolicy", "Unsupported value"),
        (
            {"model": {"family": "gpt", "path": "/models/x", "loops": 1}},
            "spec.model.family",
            "Unsupported value",
        ),
        ({"image": ""}, "spec.image", "should be at least 1 chars long"),
        (
            {"model": {"family": "llama", "packaged": "gpt-2"}},
            "spec.model.packaged",
            "Unsupported value",
        ),
        (
            # A oneOf failure names its field in the message only (the cause says "<nil>").
            {"model": {"family": "llama", "path": "/m", "packaged": "SmolLM2-135M-Instruct"}},
            "<nil>",
            '"spec.model" must validate one and only one schema (oneOf). Found 2 valid',
        ),
    ],
)
def test_api_server_rejects_pools_outside_the_crd_schema(
    apiserver: KubeApiServer, spec: dict[str, Any], field: str, reason: str
) -> None:
    valid = pool_manifest("schema-check")
    # The same pool without the bad field passes the schema (dry run: nothing is stored).
    _ok(apiserver.request("POST", f"{POOLS}?dryRun=All", valid))

    status, answer = apiserver.request("POST", POOLS, pool_manifest("schema-check", **spec))

    assert status == 422, answer
    assert answer["reason"] == "Invalid"
    assert any(c.get("field") == field for c in answer["details"]["causes"]), answer
    assert reason in answer["message"], answer
    assert apiserver.request("GET", f"{POOLS}/schema-check")[0] == 404


def test_api_server_accepts_the_model_sources(apiserver: KubeApiServer) -> None:
    """A packaged model and a .gguf file on a volume are pools the API server stores."""
    packaged = {"family": "llama", "packaged": "SmolLM2-135M-Instruct"}
    on_volume = {
        "family": "llama",
        "volume": {"persistentVolumeClaim": {"claimName": "models"}, "subPath": "smol.gguf"},
    }
    for model in (packaged, on_volume):
        _ok(apiserver.request("POST", f"{POOLS}?dryRun=All", pool_manifest("src", model=model)))


def test_operator_account_is_bound_by_the_chart_role(apiserver: KubeApiServer) -> None:
    """RBAC is really enforced: the account can do what the Role grants and nothing else."""
    token = apiserver.operator_token
    assert apiserver.request("GET", PODS, token=token)[0] == 200
    assert apiserver.request("GET", POOLS, token=token)[0] == 200
    denied = [
        ("GET", "/api/v1/namespaces/kube-system/pods"),  # another namespace
        ("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets"),  # no list: only create is granted
        # no get, not even of the Secret the operator writes (its token is derived, tokens.py)
        ("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{admin_token_secret_name('pool')}"),
        ("PATCH", f"/api/v1/namespaces/{NAMESPACE}/secrets/anything"),
        ("DELETE", f"/api/v1/namespaces/{NAMESPACE}/services/anything"),  # no delete
        ("GET", CRDS),  # no CRD access at all
    ]
    for method, path in denied:
        status, answer = apiserver.request(method, path, token=token)
        assert status == 403, (method, path, answer)


# A kubeconfig exec credential plugin, as cloud providers ship them (a token helper the
# kubeconfig names): the n-th run prints tokens[n] as an ExecCredential, or fails as a helper
# that is not signed in does; every run is counted in the file named first.
_EXEC_PLUGIN = """
import json, os, pathlib, sys
calls, tokens = pathlib.Path(sys.argv[1]), sys.argv[2:]
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
assert info["kind"] == "ExecCredential", info
n = len(calls.read_text().splitlines()) if calls.exists() else 0
with calls.open("a") as log:
    log.write(f"{n}\\n")
if n >= len(tokens) or tokens[n] == "fail":
    print("credential helper: not signed in", file=sys.stderr)
    sys.exit(3)
status = {"token": tokens[n]}
print(json.dumps({"apiVersion": info["apiVersion"], "kind": "ExecCredential", "status": status}))
"""


def _exec_plugin_kubeconfig(
    apiserver: KubeApiServer, tmp_path: Path, tokens: list[str]
) -> tuple[Path, Path]:
    """(kubeconfig, file counting the plugin's runs)"""
    plugin = tmp_path / "credential-helper.py"
    plugin.write_text(_EXEC_PLUGIN)
    calls = tmp_path / "plugin-calls"
    kubeconfig = apiserver.kubeconfig(
        tmp_path / "kubeconfig",
        exec_plugin=[sys.executable, str(plugin), str(calls), *tokens],
        namespace=NAMESPACE,
    )
    return kubeconfig, calls


async def test_operator_logs_in_through_a_kubeconfig_exec_plugin(
    apiserver: KubeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator's client runs the kubeconfig's exec plugin; a credential the server refuses
    (an expired one) means one fresh login, which runs the plugin again."""
    kubeconfig, calls = _exec_plugin_kubeconfig(
        apiserver, tmp_path, ["expired-token", apiserver.operator_token]
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    kube = KubeApi(default_login(kopf.OperatorSettings()), timeout_s=10)
    try:
        assert await kube.list(PODS_RESOURCE, NAMESPACE, {}) == []
    finally:
        await kube.close()
    assert calls.read_text().split() == ["0", "1"]


async def test_a_failing_exec_plugin_is_a_clear_login_error(
    apiserver: KubeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig, _ = _exec_plugin_kubeconfig(apiserver, tmp_path, ["fail"])
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    kube = KubeApi(default_login(kopf.OperatorSettings()), timeout_s=10)
    try:
        with pytest.raises(ApiError) as failed:
            await kube.list(PODS_RESOURCE, NAMESPACE, {})
    finally:
        await kube.close()
    assert failed.value.status == 401 and failed.value.reason == "LoginFailed"
    assert "returned 3" in failed.value.message, failed.value.message
    assert "not signed in" in failed.value.message, failed.value.message


async def test_pool_gets_owned_children_and_status_subresource(
    apiserver: KubeApiServer, admin_api: FakeAdminApi, pools: Pools
) -> None:
    pool = await pools.create("alpha", replicas=2)
    uid = pool["metadata"]["uid"]
    assert pool["metadata"]["generation"] == 1

    children = [
        (f"{PODS}/alpha-0", "Pod"),
        (f"{PODS}/alpha-1", "Pod"),
        (f"/api/v1/namespaces/{NAMESPACE}/services/alpha-executors", "Service"),
        (f"/api/v1/namespaces/{NAMESPACE}/services/alpha-admission", "Service"),
        (f"/api/v1/namespaces/{NAMESPACE}/configmaps/alpha-admission", "ConfigMap"),
        (f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/alpha-admission", "Deployment"),
    ]
    for path, kind in children:
        child = await eventually(lambda path=path: get(apiserver, path), f"{kind} {path}")
        [owner] = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("ExecutorPool", "alpha", uid)
        assert owner["controller"] is True

    await pools.start_pods(["alpha-0", "alpha-1"])
    ready = await pool_status(apiserver, "alpha", phase="Ready", readyReplicas=2)
    # Status went through the status subresource only: the spec and generation are untouched.
    assert ready["metadata"]["generation"] == 1
    assert ready["spec"] == pool["spec"]
    assert {e["name"] for e in ready["status"]["executors"]} == {"alpha-0", "alpha-1"}
    assert set(admin_api.members) == {"alpha-0", "alpha-1"}
    # Events are posted in the background and a refused one is only logged: wait for them.
    await eventually(lambda: executor_events(apiserver, "alpha", 2), "ExecutorCreated events")


async def test_scale_subresource_scales_the_pool(apiserver: KubeApiServer, pools: Pools) -> None:
    await pools.create("beta", replicas=1)
    await pools.start_pods(["beta-0"])
    await pool_status(apiserver, "beta", phase="Ready", readyReplicas=1)
    scale_path = f"{POOLS}/beta/scale"
    scale = await get(apiserver, scale_path)
    assert scale is not None
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (1, 1)

    # What `kubectl scale executorpool/beta --replicas=3` sends.
    patch = {"spec": {"replicas": 3}}
    _ok(await call(apiserver, "PATCH", scale_path, patch, content_type=MERGE))

    await pools.start_pods(["beta-1", "beta-2"])
    scaled = await pool_status(apiserver, "beta", phase="Ready", readyReplicas=3, replicas=3)
    assert scaled["spec"]["replicas"] == 3
    assert scaled["metadata"]["generation"] == 2  # the scale write bumped it, as a spec write
    scale = await get(apiserver, scale_path)
    assert scale is not None
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (3, 3)
    assert scale["status"]["selector"] == scaled["status"]["selector"]


async def test_autoscaling_follows_the_queue_through_the_scale_subresource(
    apiserver: KubeApiServer, admin_api: FakeAdminApi, pools: Pools
) -> None:
    """A burst in the queue scales up (capped per step), a quiet queue scales down one
    executor per step after draining it, down to the minimum; every step is an Event."""
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetConsumerLagPerExecutor": 10,
        "maxScaleUpStep": 2,
        "scaleDownStabilizationSeconds": 0,
        "syncPeriodSeconds": 1,
    }
    admin_api.queue = QueueLoad(consumer_lag=0, unplaced=0)
    await pools.create("gamma", replicas=1, autoscaling=autoscaling)
    await pools.start_pods(["gamma-0"])
    await pool_status(apiserver, "gamma", phase="Ready", readyReplicas=1)

    admin_api.queue = QueueLoad(consumer_lag=35, unplaced=0)  # ceil(35 / 10) = 4
    await pools.start_pods(["gamma-1", "gamma-2", "gamma-3"])
    scaled = await pool_status(apiserver, "gamma", phase="Ready", readyReplicas=4, replicas=4)
    assert scaled["spec"]["replicas"] == 4
    assert scaled["status"]["autoscaling"]["desiredReplicas"] == 4
    ups = await scaling_events(apiserver, "gamma", "ScaledUp")
    assert {m.split(":")[0] for m in ups} == {"1 -> 3 executors", "3 -> 4 executors"}

    admin_api.queue = QueueLoad(consumer_lag=0, unplaced=0)
    quiet = await pool_status(apiserver, "gamma", phase="Ready", readyReplicas=1, replicas=1)
    assert quiet["spec"]["replicas"] == 1
    downs = await scaling_events(apiserver, "gamma", "ScaledDown")
    assert {m.split(":")[0] for m in downs} == {
        "4 -> 3 executors",
        "3 -> 2 executors",
        "2 -> 1 executors",
    }
    # Each removed executor was drained through the admin API before its pod went.
    drained = {call.path.split("/")[3] for call in admin_api.calls("POST", "/v1/executors/")}
    assert drained == {"gamma-1", "gamma-2", "gamma-3"}
    condition = next(c for c in quiet["status"]["conditions"] if c["type"] == "Autoscaling")
    assert (condition["status"], condition["reason"]) == ("True", "ScalingActive")


async def scaling_events(apiserver: KubeApiServer, pool: str, reason: str) -> list[str]:
    events = await get(apiserver, f"/api/v1/namespaces/{NAMESPACE}/events")
    assert events is not None
    mine = [
        e for e in events["items"] if e["reason"] == reason and e["involvedObject"]["name"] == pool
    ]
    return [e["message"] for e in mine]
