"""Regressions in ``kvgate executor``'s server found by the crash scenarios (1 and 2).

- An admission service that dies while the executor runs its plan: the dead peer's socket is
  closing when the result is ready, and sending it raised ``ClientConnectionResetError`` out of
  the session handler — an "Error handling request" traceback on every admission crash, and the
  handler's clean-up skipped (the dead session stayed the executor's current one). The executor
  must drop the result quietly and end the session.
- A new session resets the executor, but its leak gauges (requests, snapshots, host blocks held)
  kept the old session's values until the next step ran: an idle executor reported requests it
  no longer held. They must read zero as soon as the new epoch is accepted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvgate.executor.executor import Executor
from kvgate.protocol import step as wire
from kvgate.step_server.server import StepServer
from tests.reliability.processes import parse_metrics, poll

pytestmark = pytest.mark.timeout(120)
TOKEN = "peer-loss-token"


def _fill_plan() -> wire.StepPlan:
    return wire.StepPlan(
        step_id=1,
        new_requests=[wire.NewRequest(request_id="r", prompt_token_ids=[5, 9, 2, 7])],
        block_appends=[wire.BlockAppend(request_id="r", new_block_ids=[[0], [1], [2]])],
        prefill_rows=[
            wire.PrefillRow(
                request_id="r", token_start=0, token_end=4, depth_first=1, depth_last=3,
                completes_fill=True,
            )
        ],
    )  # fmt: skip


async def _open(client: TestClient, epoch: int) -> Any:
    ws = await client.ws_connect("/v1/steps", headers={"Authorization": f"Bearer {TOKEN}"})
    await ws.send_str(wire.SessionOpen(epoch=epoch, session_id=f"s{epoch}").model_dump_json())
    assert "accepted" in await ws.receive_str(timeout=10)
    return ws


async def test_peer_gone_while_a_plan_runs_ends_the_session_quietly(
    looped_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvgate.executor.loader import load_model

    entered, release = threading.Event(), threading.Event()

    def load() -> Executor:
        executor = Executor(load_model(looped_model), num_blocks=16, block_size=4)
        execute = executor.execute

        def held(plan: wire.StepPlan) -> wire.StepResult:
            entered.set()
            release.wait(timeout=60)  # the peer dies while the plan runs
            return execute(plan)

        executor.execute = held  # type: ignore[method-assign]
        return executor

    server = StepServer(load, TOKEN)
    client = TestClient(TestServer(server.app()))
    await client.start_server()
    caplog.set_level(logging.ERROR, logger="aiohttp.server")
    try:
        await server.wait_loaded()
        ws = await _open(client, epoch=1)
        await ws.send_str(_fill_plan().model_dump_json())
        await asyncio.to_thread(entered.wait, 30)
        session = server._session
        assert session is not None
        # The peer vanishes without a close handshake (SIGKILL): its socket is just reset.
        transport = ws._response.connection.transport  # type: ignore[union-attr]
        transport.abort()
        # The handler has seen the socket end and waits for the running plan.
        await asyncio.to_thread(poll, lambda: session.queue.qsize() > 0, "the reader to end")
        release.set()
        await asyncio.to_thread(poll, lambda: server._session is None, "the session to end", 30)
        assert not [r for r in caplog.records if "Error handling request" in r.getMessage()]
    finally:
        release.set()
        await client.close()


async def test_a_new_session_zeroes_the_leak_gauges(looped_model: Path) -> None:
    from kvgate.executor.loader import load_model

    model = load_model(looped_model)
    server = StepServer(lambda: Executor(model, num_blocks=16, block_size=4), TOKEN)
    client = TestClient(TestServer(server.app()))
    await client.start_server()
    held = (
        "kvgate_executor_requests",
        "kvgate_executor_snapshots",
        "kvgate_executor_host_blocks_used",
    )
    try:
        await server.wait_loaded()
        first = await _open(client, epoch=1)
        await first.send_str(_fill_plan().model_dump_json())
        result = wire.StepResult.model_validate_json(await first.receive_str(timeout=30))
        assert result.error is None and result.counters.num_requests == 1
        samples = parse_metrics(await (await client.get("/metrics")).text())
        assert samples["kvgate_executor_requests"] == 1
        await _open(client, epoch=2)  # fences the first session and resets the executor
        samples = parse_metrics(await (await client.get("/metrics")).text())
        assert {name: samples[name] for name in held} == dict.fromkeys(held, 0.0)
    finally:
        await client.close()
