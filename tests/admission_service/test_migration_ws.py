"""Drain with migration over the real protocol: two step servers on HTTP, the service's
WebSocket connector, the receiver fetching from the sender itself (``POST /v1/snapshots/import``
→ ``GET /v1/snapshots/{ticket}``) — for the simulated and the real executor (a tiny random
checkpoint). Outputs equal a run that never drained; migrated requests recompute nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvgate.admission_service.executor_client import WebSocketConnector
from kvgate.protocol.admin import ExecutorSpec, ExecutorState
from kvgate.protocol.records import ResultStatus
from kvgate.sim.backend import SimBackend, SimExecutorConfig
from kvgate.sim.server import sim_step_server
from kvgate.step_server.server import StepBackend, StepServer

from .helpers import EngineRig, make_rig, request_body, settle, until
from .test_migration import outcomes

pytestmark = pytest.mark.timeout(300)  # real executors on a loaded 2-core machine took up to 2 min

TOKEN = "migration-ws-token"
HOST_BLOCKS = 512


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
    from kvgate.protocol.enums import ModelFamily

    spec = TinyModelSpec(family=ModelFamily.LLAMA, vocab_size=128, seed=3)
    return Path(make_tiny_model(tmp_path_factory.mktemp("tiny"), spec))


def _server(kind: str, tiny_dir: Path) -> StepServer:
    if kind == "sim":
        config = SimExecutorConfig(num_blocks=128, block_size=4, host_snapshot_blocks=HOST_BLOCKS)
        return sim_step_server(SimBackend(config), TOKEN, step_time_s=0.005)

    def load() -> StepBackend:
        import torch

        from kvgate.executor.executor import Executor
        from kvgate.executor.loader import load_model

        torch.set_num_threads(1)
        return Executor(
            load_model(tiny_dir), num_blocks=128, block_size=4, host_snapshot_blocks=HOST_BLOCKS
        )

    return StepServer(load, TOKEN)


def _bodies(kind: str) -> list[dict[str, object]]:
    count = 6 if kind == "sim" else 3
    return [
        request_body(
            f"w{i}",
            prompt=[(11 * i + 5 * j) % 120 + 1 for j in range(6 + 3 * i)],
            max_tokens=30,
            sampling={"ignore_eos": True, "temperature": 0.0},
        )
        for i in range(count)
    ]


async def _run(
    kind: str, tiny_dir: Path, http: aiohttp.ClientSession, *, drain: bool
) -> tuple[EngineRig, dict[str, list[int]], list[str]]:
    servers = [TestServer(_server(kind, tiny_dir).app(), host="127.0.0.1") for _ in range(2)]
    for server in servers:
        await server.start_server()
    connector = WebSocketConnector(
        http, TOKEN, connect_timeout_s=5.0, heartbeat_s=5.0, step_timeout_s=30.0
    )
    rig = make_rig(migrate_on_drain=True, connector=connector)
    specs = [
        ExecutorSpec(name=name, endpoint=f"ws://127.0.0.1:{server.port}/v1/steps")
        for name, server in zip("ab", servers, strict=True)
    ]
    moved: list[str] = []
    try:
        await rig.engine.set_members(specs[:1])
        await until(lambda: rig.engine.handles["a"].accepts_work, what="a ready", timeout_s=60)
        bodies = _bodies(kind)
        for body in bodies:
            rig.submit(body)
        if drain:
            a = rig.engine.handles["a"]

            def decoding() -> list[str]:
                assert a.scheduler is not None
                requests = a.scheduler.state.requests.values()
                return [r.request_id for r in requests if len(r.output_token_ids) >= 3]

            ready: Callable[[], bool] = lambda: len(decoding()) == len(bodies)  # noqa: E731
            await until(ready, what="every request decoding on a", timeout_s=60)
            await rig.engine.set_members([specs[0].model_copy(update={"draining": True}), specs[1]])
            moved = decoding()
        await settle(rig, len(bodies), timeout_s=90)
        if drain:
            await until(lambda: rig.engine.handles["a"].state is ExecutorState.DRAINED)
        out = {rid: r.output_token_ids for rid, r in rig.sink.answers.items()}
        assert Counter(r.request_id for r in rig.sink.answer_log) == Counter(list(out))
        assert {r.status for r in rig.sink.answers.values()} == {ResultStatus.COMPLETED}
        return rig, out, moved
    finally:
        await rig.engine.close()
        for server in servers:
            await server.close()


@pytest.mark.parametrize("kind", ["sim", "real"])
async def test_drain_over_http_moves_kv_and_keeps_outputs(kind: str, tiny_dir: Path) -> None:
    async with aiohttp.ClientSession() as http:
        _, expected, _ = await _run(kind, tiny_dir, http, drain=False)
        rig, got, moved = await _run(kind, tiny_dir, http, drain=True)
    assert got == expected
    assert moved, "requests were mid-decode when the drain began"
    assert outcomes(rig) == {"migrated": len(moved)}
    for rid in moved:
        assert rig.sink.answers[rid].scheduling.recomputed_tokens == 0, rid
    assert all(rig.sink.answers[rid].scheduling.executors == ["a", "b"] for rid in moved)
