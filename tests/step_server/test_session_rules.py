"""Both executors apply the same session rules: one step server, one epoch fence.

Each test runs against ``kvgate executor``'s backend (a tiny real model) and against
``kvgate sim-executor``'s (the simulated model), over the real WebSocket protocol: a wrong
protocol version is refused, an epoch no wall clock can have reached is refused, and a client
holding the token that jumps the epoch just under the ceiling locks the service out for at most
the allowed lead — the service's next wall-clock epoch is accepted again after it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvgate.protocol import step as wire
from kvgate.protocol.session import EpochFence, wall_clock_ms
from kvgate.sim.backend import SimBackend, SimExecutorConfig
from kvgate.step_server.server import StepBackend, StepServer

TOKEN = "session-rules-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LEAD_S = 1.0

Client = TestClient[aiohttp.web.Request, aiohttp.web.Application]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
    from kvgate.protocol.enums import ModelFamily

    spec = TinyModelSpec(family=ModelFamily.LLAMA, vocab_size=64, seed=5)
    return Path(make_tiny_model(tmp_path_factory.mktemp("tiny"), spec))


def _real(tiny_dir: Path) -> Callable[[], StepBackend]:
    def load() -> StepBackend:
        from kvgate.executor.executor import Executor
        from kvgate.executor.loader import load_model

        return Executor(load_model(tiny_dir), num_blocks=8, block_size=4)

    return load


@pytest.fixture(params=["real", "sim"])
async def client(request: pytest.FixtureRequest, tiny_dir: Path) -> AsyncIterator[Client]:
    fence = EpochFence(max_lead_s=LEAD_S)
    if request.param == "real":
        server = StepServer(_real(tiny_dir), TOKEN, fence=fence)
    else:
        backend = SimBackend(SimExecutorConfig(), fence=fence)
        server = StepServer(lambda: backend, TOKEN, fence=fence)
    test_client = TestClient(TestServer(server.app(), host="127.0.0.1"))
    await test_client.start_server()
    await server.wait_loaded()
    yield test_client
    await test_client.close()


async def _open(client: Client, body: dict[str, object]) -> dict[str, object]:
    ws = await client.ws_connect("/v1/steps", headers=AUTH)
    await ws.send_str(json.dumps({"type": "open", "session_id": "t", **body}))
    reply: dict[str, object] = json.loads(await ws.receive_str(timeout=10))
    await ws.close()
    return reply


async def test_a_different_protocol_version_is_refused(client: Client) -> None:
    reply = await _open(client, {"epoch": wall_clock_ms(), "protocol_version": 99})
    assert reply["type"] == "error" and reply["code"] == wire.ErrorCode.PROTOCOL.value
    assert "protocol version 99" in str(reply["message"])
    accepted = await _open(client, {"epoch": wall_clock_ms()})
    assert accepted["type"] == "accepted"


@pytest.mark.parametrize("epoch", [10**20, 2**63 - 1, "far-ahead"])
async def test_an_epoch_beyond_any_clock_is_refused_and_locks_nobody_out(
    client: Client, epoch: int | str
) -> None:
    value = wall_clock_ms() + 3_600_000 if epoch == "far-ahead" else epoch
    reply = await _open(client, {"epoch": value})
    assert reply["type"] == "error" and reply["code"] == wire.ErrorCode.PROTOCOL.value
    assert "epoch" in str(reply["message"])
    # The admission service's own epoch (its wall clock) is still accepted.
    assert (await _open(client, {"epoch": wall_clock_ms()}))["type"] == "accepted"


async def test_a_jump_under_the_ceiling_locks_the_service_out_for_at_most_the_lead(
    client: Client,
) -> None:
    jumped = wall_clock_ms() + int(LEAD_S * 1000) - 50
    assert (await _open(client, {"epoch": jumped}))["type"] == "accepted"
    stale = await _open(client, {"epoch": wall_clock_ms()})
    assert stale["type"] == "error" and stale["code"] == wire.ErrorCode.STALE_EPOCH.value
    deadline = time.monotonic() + 10 * LEAD_S
    while True:
        reply = await _open(client, {"epoch": wall_clock_ms()})
        if reply["type"] == "accepted":
            break
        assert time.monotonic() < deadline, f"still locked out: {reply}"
        await asyncio.sleep(0.05)  # poll interval of the retrying service, not a timing assertion
    assert wall_clock_ms() > jumped
