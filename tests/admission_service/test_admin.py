"""The admin API: membership (the operator's contract), drains, auth, bad bodies, health,
readiness and the Prometheus metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvgate.admission_service.admin import AdminApi
from kvgate.admission_service.metrics import StateSnapshot
from kvgate.protocol.admin import (
    AdminError,
    ExecutorMembership,
    ExecutorSet,
    ExecutorSpec,
    ExecutorState,
    ExecutorStatus,
)
from kvgate.sim.backend import SimExecutorConfig

from .helpers import EngineRig, make_rig, request_body, settle, until

pytestmark = pytest.mark.timeout(60)
AUTH = {"Authorization": "Bearer admin-secret"}


@pytest.fixture
async def rig() -> AsyncIterator[EngineRig]:
    rig = make_rig()
    for name in ("a", "b"):
        rig.connector.add(name, SimExecutorConfig(num_blocks=64, block_size=4))
    yield rig
    await rig.engine.close()


async def client_for(
    rig: EngineRig, *, token: str | None = "admin-secret", ready: bool = True
) -> TestClient:
    engine = rig.engine
    rig.engine.metrics.bind_state(
        lambda: StateSnapshot(
            unplaced=0, executors=engine.executor_gauges(), consumer_lag={0: 7}, paused=False
        )
    )
    api = AdminApi(engine, engine.metrics, token=token, ready=lambda: ready, healthy=lambda: True)
    client = TestClient(TestServer(api.app()))
    await client.start_server()
    return client


def members(*names: str, draining: tuple[str, ...] = ()) -> str:
    specs = [
        ExecutorSpec(name=n, endpoint=f"ws://local/{n}", draining=n in draining) for n in names
    ]
    return ExecutorSet(executors=specs).model_dump_json()


async def test_membership_put_get_and_drain_to_drained(rig: EngineRig) -> None:
    client = await client_for(rig)
    try:
        response = await client.put("/v1/executors", data=members("a", "b"), headers=AUTH)
        assert response.status == 200
        await until(
            lambda: all(h.state is ExecutorState.READY for h in rig.engine.handles.values())
        )
        body = ExecutorMembership.model_validate_json(
            await (await client.get("/v1/executors")).text()
        )
        assert {(e.name, e.state) for e in body.executors} == {
            ("a", ExecutorState.READY),
            ("b", ExecutorState.READY),
        }
        assert all(e.kv_blocks_total == 64 for e in body.executors)
        for i in range(4):
            rig.submit(request_body(f"d{i}"))
        response = await client.post("/v1/executors/a/drain", headers=AUTH)
        status = ExecutorStatus.model_validate_json(await response.text())
        assert status.state in (ExecutorState.DRAINING, ExecutorState.DRAINED)

        async def state_of(name: str) -> ExecutorState:
            got = await client.get(f"/v1/executors/{name}")
            return ExecutorStatus.model_validate_json(await got.text()).state

        await settle(rig, 4)
        await until(lambda: rig.engine.handles["a"].state is ExecutorState.DRAINED)
        assert await state_of("a") is ExecutorState.DRAINED
        # The operator then removes it from the membership.
        response = await client.put("/v1/executors", data=members("b"), headers=AUTH)
        assert response.status == 200
        assert set(rig.engine.handles) == {"b"}
        missing = await client.get("/v1/executors/a")
        assert missing.status == 404
        assert AdminError.model_validate_json(await missing.text()).error == "unknown executor"
    finally:
        await client.close()


async def test_putting_draining_true_marks_it_draining(rig: EngineRig) -> None:
    client = await client_for(rig)
    try:
        await client.put("/v1/executors", data=members("a", "b", draining=("b",)), headers=AUTH)
        await until(lambda: rig.engine.handles["b"].state is ExecutorState.DRAINED)
        assert rig.engine.handles["a"].state is ExecutorState.READY
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("headers", "status", "error"),
    [({}, 401, "unauthorized"), ({"Authorization": "Bearer wrong"}, 401, "unauthorized")],
)
async def test_mutations_need_the_admin_token(
    rig: EngineRig, headers: dict[str, str], status: int, error: str
) -> None:
    client = await client_for(rig)
    try:
        for response in (
            await client.put("/v1/executors", data=members("a"), headers=headers),
            await client.post("/v1/executors/a/drain", headers=headers),
        ):
            assert response.status == status
            assert AdminError.model_validate_json(await response.text()).error == error
        assert rig.engine.handles == {}
    finally:
        await client.close()


async def test_without_a_configured_token_mutations_are_refused(rig: EngineRig) -> None:
    client = await client_for(rig, token=None)
    try:
        response = await client.put("/v1/executors", data=members("a"), headers=AUTH)
        assert response.status == 403
        assert (await client.get("/v1/executors")).status == 200
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ("{", "Invalid JSON"),
        ('{"executors": [{"name": "A!", "endpoint": "ws://x"}]}', "executors.0.name"),
        ('{"executors": [{"name": "a", "endpoint": "http://x"}]}', "executors.0.endpoint"),
        ('{"executors": [], "extra": 1}', "extra"),
        (
            '{"executors": [{"name": "a", "endpoint": "ws://x"}, {"name": "a", "endpoint": "ws://y"}]}',
            "duplicate executor names",
        ),
    ],
)
async def test_bad_bodies_are_422_naming_the_problem(
    rig: EngineRig, body: str, detail: str
) -> None:
    client = await client_for(rig)
    try:
        response = await client.put("/v1/executors", data=body, headers=AUTH)
        assert response.status == 422
        error = AdminError.model_validate_json(await response.text())
        assert detail in (error.detail or "")
        assert rig.engine.handles == {}
    finally:
        await client.close()


async def test_health_readiness_and_metrics(rig: EngineRig) -> None:
    client = await client_for(rig, ready=False)
    try:
        assert (await client.get("/healthz")).status == 200
        assert (await client.get("/readyz")).status == 503
        await client.put("/v1/executors", data=members("a"), headers=AUTH)
        await until(lambda: rig.engine.handles["a"].state is ExecutorState.READY)
        rig.submit(request_body("m1"))
        rig.submit({"request_id": "m2", "prompt": [1], "priority": 10**6})
        await settle(rig, 2)
        text = await (await client.get("/metrics")).text()
        for needle in (
            "kvgate_admission_queue_depth 0.0",
            'kvgate_admission_kv_blocks_total{executor="a"} 64.0',
            'kvgate_admission_consumer_lag{partition="0"} 7.0',
            'kvgate_admission_results_total{status="completed"} 1.0',
            'kvgate_admission_rejections_total{code="priority_out_of_range"} 1.0',
            'kvgate_admission_executor_state{executor="a",state="ready"} 1.0',
            "kvgate_admission_steps_total",
            "kvgate_admission_step_round_trip_seconds_bucket",
        ):
            assert needle in text, needle
    finally:
        await client.close()
