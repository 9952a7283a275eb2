"""The gateway names each request's tenant from its API key (the admission service's fair
sharing and quotas read it from the record)."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace import TracerProvider

from kvgate.gateway.server import Gateway
from kvgate.gateway.settings import ApiKey, GatewaySettings, ModelRoute
from kvgate.kafka_connection import KafkaConnection
from kvgate.protocol.records import InferenceRequest

TEAM = ApiKey(name="k-team", key="sk-team-0123456789abcdef", tenant="team-a")
PLAIN = ApiKey(name="k-plain", key="sk-plain-0123456789abcdef")


def test_a_key_without_a_tenant_is_its_own() -> None:
    assert (TEAM.tenant_name, PLAIN.tenant_name) == ("team-a", "k-plain")


async def test_the_record_carries_the_key_s_tenant() -> None:
    sent: list[InferenceRequest] = []

    async def send(topic: str, request: InferenceRequest, **_: Any) -> None:
        sent.append(request)

    settings = GatewaySettings(
        kafka=KafkaConnection(bootstrap_servers="127.0.0.1:1"),
        models=[ModelRoute(name="m")],
        keys=[TEAM, PLAIN],
        request_timeout_s=0.2,
    )
    gateway = Gateway(settings, tracer=TracerProvider().get_tracer("test"))
    gateway.bridge.send = send  # type: ignore[method-assign]
    gateway.bridge.ready.set()
    async with TestClient(TestServer(gateway.app(), host="127.0.0.1")) as http:
        for key in (TEAM, PLAIN):
            response = await http.post(
                "/v1/completions",
                json={"model": "m", "prompt": "hi"},
                headers={"Authorization": f"Bearer {key.key}"},
            )
            assert response.status == 504  # nobody answers here
    assert [request.tenant for request in sent] == ["team-a", "k-plain"]
