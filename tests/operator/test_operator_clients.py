"""The two API clients: Kubernetes (against the emulator) and the admin API (against the fake)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import aiohttp
import kmock
import kopf
import pytest

from kvgate.operator.admin import AdminClient, AdminRejected, AdminUnavailable
from kvgate.operator.kube import PODS, ApiError, KubeApi, TransientApiError
from kvgate.protocol.admin import ExecutorSet, ExecutorSpec, ExecutorState
from tests.operator.fake_admin import FakeAdminApi
from tests.operator.kube_emulator import KubeEmulator


def _pod(name: str, **labels: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
async def api() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator() as emulator, kmock.Server(emulator):
        yield emulator


def _client(api: KubeEmulator, tokens: list[str]) -> KubeApi:
    """A client whose n-th login hands out tokens[n] (the last one from then on)."""
    logins = iter(tokens)
    last = [tokens[-1]]

    async def login() -> kopf.ConnectionInfo:
        token = next(logins, last[0])
        return kopf.ConnectionInfo(server=str(api.url), scheme="Bearer", token=token)

    return KubeApi(login, timeout_s=5)


async def test_create_get_list_patch_delete(api: KubeEmulator) -> None:
    kube = _client(api, ["t"])
    try:
        assert await kube.create(PODS, "default", _pod("a", pool="p", component="executor"))
        assert not await kube.create(PODS, "default", _pod("a"))  # 409: already there
        assert await kube.create(PODS, "default", _pod("b", pool="p", component="admission"))
        assert await kube.create(PODS, "default", _pod("c", pool="q"))

        got = await kube.get(PODS, "default", "a")
        assert got is not None and got["metadata"]["name"] == "a"
        assert await kube.get(PODS, "default", "missing") is None

        listed = await kube.list(PODS, "default", {"pool": "p", "component": "executor"})
        assert [p["metadata"]["name"] for p in listed] == ["a"]

        patch = {"metadata": {"annotations": {"x": "1"}}}
        assert await kube.merge_patch(PODS, "default", "a", patch)
        assert (await kube.get(PODS, "default", "a") or {})["metadata"]["annotations"] == {"x": "1"}
        assert not await kube.merge_patch(PODS, "default", "missing", patch)

        assert got["metadata"]["uid"]
        assert not await kube.delete(PODS, "default", "a", uid="another-uid")  # precondition
        assert await kube.delete(PODS, "default", "a", uid=got["metadata"]["uid"])
        assert not await kube.delete(PODS, "default", "a", uid=got["metadata"]["uid"])  # gone
        assert api.journal[-1].user_agent == "kvgate-operator"
    finally:
        await kube.close()


async def test_a_rejected_token_means_one_fresh_login(api: KubeEmulator) -> None:
    api[kmock.headers({"Authorization": "Bearer stale"})] << 401
    kube = _client(api, ["stale", "fresh"])
    try:
        assert await kube.get(PODS, "default", "nothing") is None  # 401, login, retry: 404
        assert [c.status for c in api.journal] == [401, 404]
        api[kmock.headers({"Authorization": "Bearer fresh"})] << 401
        with pytest.raises(ApiError) as caught:  # a second refusal is final
            await kube.get(PODS, "default", "nothing")
        assert caught.value.status == 401
    finally:
        await kube.close()


async def test_errors_are_classified(api: KubeEmulator) -> None:
    api["get /api/v1/namespaces/default/pods/busy"] << 503
    api["get /api/v1/namespaces/default/pods/forbidden"] << 403
    kube = _client(api, ["t"])
    try:
        with pytest.raises(TransientApiError):
            await kube.get(PODS, "default", "busy")
        with pytest.raises(ApiError) as forbidden:
            await kube.get(PODS, "default", "forbidden")
        assert not isinstance(forbidden.value, TransientApiError)
        assert forbidden.value.status == 403
    finally:
        await kube.close()

    async def login() -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=f"http://127.0.0.1:{_free_port()}")

    unreachable = KubeApi(login, timeout_s=5)
    try:
        with pytest.raises(TransientApiError):
            await unreachable.get(PODS, "default", "x")
    finally:
        await unreachable.close()


@pytest.fixture
async def admin() -> AsyncIterator[FakeAdminApi]:
    fake = FakeAdminApi(token=lambda: "right")
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as client:
        yield client


MEMBERS = ExecutorSet(
    executors=[
        ExecutorSpec(name="p-0", endpoint="ws://10.0.0.1:8000/v1/steps"),
        ExecutorSpec(name="p-1", endpoint="ws://10.0.0.2:8000/v1/steps"),
    ]
)


async def test_membership_and_drain(admin: FakeAdminApi, session: aiohttp.ClientSession) -> None:
    client = AdminClient(session, admin.url, "right")
    assert (await client.membership()).executors == []
    await client.set_membership(MEMBERS)
    assert [e.name for e in (await client.membership()).executors] == ["p-0", "p-1"]
    admin.set_running("p-1", 3)
    assert (await client.drain("p-1")).state is ExecutorState.DRAINING
    assert (await client.drain("p-0")).state is ExecutorState.DRAINED  # idle: drained at once
    assert admin.journal[-1].method == "POST"


async def test_admin_refusals_and_outages(
    admin: FakeAdminApi, session: aiohttp.ClientSession
) -> None:
    with pytest.raises(AdminRejected, match="HTTP 401: unauthorized"):
        await AdminClient(session, admin.url, "wrong").set_membership(MEMBERS)
    client = AdminClient(session, admin.url, "right")
    with pytest.raises(AdminRejected, match="HTTP 404: unknown executor: p-9"):
        await client.drain("p-9")
    admin.unavailable = True
    with pytest.raises(AdminUnavailable, match="HTTP 503"):
        await client.membership()
    gone = AdminClient(session, f"http://127.0.0.1:{_free_port()}", "right")
    with pytest.raises(AdminUnavailable):
        await gone.membership()


async def test_an_answer_that_breaks_the_contract_is_refused(
    api: KubeEmulator, session: aiohttp.ClientSession
) -> None:
    api["get /v1/executors"] << {"executors": [{"name": "x"}]}
    with pytest.raises(AdminRejected, match="unexpected answer"):
        await AdminClient(session, str(api.url).rstrip("/"), "t").membership()


async def test_a_proxy_error_page_is_a_transient_error(api: KubeEmulator) -> None:
    api["get /api/v1/namespaces/default/pods/behind-proxy"] << 502 << b"<html>Bad Gateway</html>"
    api["get /api/v1/namespaces/default/pods/odd"] << b"<html>not json</html>"
    kube = _client(api, ["t"])
    try:
        with pytest.raises(TransientApiError, match="Bad Gateway"):
            await kube.get(PODS, "default", "behind-proxy")
        with pytest.raises(TransientApiError, match="NotJson"):
            await kube.get(PODS, "default", "odd")
    finally:
        await kube.close()
