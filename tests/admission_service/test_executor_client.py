"""The WebSocket step session against the simulated executor server (the real protocol on
loopback): opening, auth, epoch fencing, ordered results with one plan in flight, loss
detection, and the engine surviving an executor restart with identical outputs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvgate.admission_service.engine import Engine
from kvgate.admission_service.executor_client import (
    ConnectFailed,
    EpochClock,
    SessionLost,
    SessionRefused,
    WebSocketConnector,
)
from kvgate.protocol import step as wire
from kvgate.protocol.admin import ExecutorSpec, ExecutorState
from kvgate.protocol.records import ResultStatus
from kvgate.protocol.step import SamplingParams
from kvgate.scheduler.request import RequestSpec
from kvgate.scheduler.scheduler import Scheduler
from kvgate.sim.backend import SimBackend, SimExecutorConfig
from kvgate.sim.server import sim_step_server

from .helpers import make_rig, reference_outputs, request_body, settle, until

pytestmark = pytest.mark.timeout(60)
TOKEN = "step-token"


async def start_server(port: int = 0, **config: object) -> tuple[TestServer, SimBackend]:
    backend = SimBackend(SimExecutorConfig(**config))  # type: ignore[arg-type]
    server = TestServer(sim_step_server(backend, TOKEN).app(), host="127.0.0.1", port=port)
    await server.start_server()
    return server, backend


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def connector(
    http: aiohttp.ClientSession, token: str = TOKEN, **timeouts: float
) -> WebSocketConnector:
    options = {"connect_timeout_s": 5.0, "heartbeat_s": 5.0, "step_timeout_s": 10.0} | timeouts
    return WebSocketConnector(http, token, **options)


def url(server: TestServer) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/steps"


def test_epochs_increase_even_when_the_clock_goes_back() -> None:
    times = iter([1000, 1000, 999, 2000])
    clock = EpochClock(lambda: next(times))
    assert [clock.next() for _ in range(4)] == [1000, 1001, 1002, 2000]


async def test_session_runs_plans_in_order_with_one_in_flight(http: aiohttp.ClientSession) -> None:
    server, backend = await start_server(num_blocks=64, block_size=4)
    try:
        session = await connector(http)(url(server), epoch=5)
        assert session.info.num_blocks == 64 and backend.fence.max_epoch == 5
        from kvgate.admission_service.executor_handle import scheduler_for
        from kvgate.scheduler.config import SchedulerConfig

        scheduler: Scheduler = scheduler_for(
            session.info,
            SchedulerConfig(
                async_scheduling=True, max_num_batched_tokens=64, prefill_chunk_size=32
            ),
            True,
        )
        scheduler.add_request(
            RequestSpec("a", (1, 2, 3, 4, 5), SamplingParams(max_tokens=6, ignore_eos=True))
        )
        finished = []
        inflight = 0
        while scheduler.has_work or inflight:
            while inflight < 2 and scheduler.has_work:
                plan = scheduler.schedule(0.0)
                if plan is None:
                    break
                await session.send(plan)
                inflight += 1
            result = await session.receive()
            inflight -= 1
            finished += [e for e in scheduler.apply(result) if hasattr(e, "reason")]
        assert len(finished) == 1 and len(finished[0].output_token_ids) == 6  # type: ignore[attr-defined]
        await session.close()
    finally:
        await server.close()


async def test_wrong_token_and_stale_epoch_are_refused(http: aiohttp.ClientSession) -> None:
    server, _ = await start_server()
    try:
        with pytest.raises(SessionRefused) as wrong:
            await connector(http, token="nope")(url(server), epoch=1)
        assert wrong.value.code is wire.ErrorCode.UNAUTHORIZED
        session = await connector(http)(url(server), epoch=10)
        with pytest.raises(SessionRefused) as stale:
            await connector(http)(url(server), epoch=10)
        assert stale.value.code is wire.ErrorCode.STALE_EPOCH
        await session.close()
    finally:
        await server.close()


async def test_a_newer_epoch_fences_the_older_session(http: aiohttp.ClientSession) -> None:
    server, _ = await start_server()
    try:
        old = await connector(http)(url(server), epoch=1)
        new = await connector(http)(url(server), epoch=2)
        with pytest.raises(SessionLost) as lost:
            await old.receive()
        assert lost.value.fenced
        assert "stale_epoch" in str(lost.value)
        await new.close()
        await old.close()
    finally:
        await server.close()


async def test_unreachable_and_closing_executors(http: aiohttp.ClientSession) -> None:
    server, _ = await start_server()
    dead_url = url(server)
    session = await connector(http)(dead_url, epoch=1)
    await server.close()
    lost = await asyncio.wait_for(session.wait_lost(), 10)
    assert "closed" in str(lost) or "error" in str(lost)
    with pytest.raises(SessionLost):
        await session.receive()
    with pytest.raises(ConnectFailed):
        await connector(http)(dead_url, epoch=2)


async def test_a_result_that_never_comes_is_a_loss(http: aiohttp.ClientSession) -> None:
    async def swallow(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.receive()
        info = SimBackend(SimExecutorConfig()).info
        await ws.send_str(wire.SessionAccepted(epoch=1, info=info).model_dump_json())
        async for _ in ws:
            pass  # reads plans, never answers
        return ws

    app = web.Application()
    app.router.add_get("/v1/steps", swallow)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        session = await connector(http, step_timeout_s=0.3)(url(server), epoch=1)
        await session.send(wire.StepPlan(step_id=1))
        with pytest.raises(SessionLost, match="no step result within"):
            await session.receive()
        await session.close()
    finally:
        await server.close()


async def test_engine_survives_an_executor_restart_with_identical_outputs(
    http: aiohttp.ClientSession,
) -> None:
    bodies = [request_body(f"w{i}", prompt_len=10 + i, max_tokens=20) for i in range(6)]
    expected = await reference_outputs(bodies, block_size=4)
    server, backend = await start_server(num_blocks=48, block_size=4, host_snapshot_blocks=8)
    port = server.port
    rig = make_rig()
    rig.engine = Engine(
        rig.engine.settings,
        connector=connector(http),
        sink=rig.sink,
        tracer=rig.engine._tracer,
        metrics=rig.engine.metrics,
    )
    engine = rig.engine
    try:
        await engine.set_members(
            [ExecutorSpec(name="x", endpoint=f"ws://127.0.0.1:{port}/v1/steps")]
        )
        await until(lambda: engine.handles["x"].state is ExecutorState.READY)
        backend.hold_after(8)
        for body in bodies:
            rig.submit(body)
        await until(lambda: backend.steps >= 8, what="progress before the restart")
        assert not rig.sink.answers, "the restart must come mid-run"
        await server.close()  # the executor dies; a new one comes up on the same address
        server, backend = await start_server(
            port, num_blocks=48, block_size=4, host_snapshot_blocks=8
        )
        await settle(rig, len(bodies))
        assert {r.status for r in rig.sink.answers.values()} == {ResultStatus.COMPLETED}
        got = {rid: (r.output_token_ids, r.exit_depths) for rid, r in rig.sink.answers.items()}
        assert got == expected
        assert engine.handles["x"].sessions == 2
    finally:
        await engine.close()
        await server.close()


def test_traceparent_of_span_matches_the_propagator() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    from kvgate.admission_service.tracing import traceparent_of_span
    from kvgate.telemetry.context import traceparent_of

    span = TracerProvider().get_tracer("t").start_span("s")
    assert traceparent_of_span(span) == traceparent_of(span.get_span_context())


async def test_a_new_session_opens_after_the_old_client_vanished(
    http: aiohttp.ClientSession,
) -> None:
    """Regression: fencing an old session whose peer died (no close handshake) must not break
    or delay the new session."""
    server, backend = await start_server()
    try:
        async with aiohttp.ClientSession() as doomed:
            ws = await doomed.ws_connect(url(server), headers={"Authorization": f"Bearer {TOKEN}"})
            await ws.send_str(wire.SessionOpen(epoch=1, session_id="old").model_dump_json())
            await ws.receive(timeout=5)
        # The old client is gone without a WebSocket close. A new one opens at once.
        session = await asyncio.wait_for(connector(http)(url(server), epoch=2), 5)
        assert backend.fence.max_epoch == 2
        await session.close()
    finally:
        await server.close()
