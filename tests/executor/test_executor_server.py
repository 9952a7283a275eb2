"""The executor server: bearer auth on the step socket only, epoch fencing, ordered pipelined
plans, malformed and inconsistent plans answered without losing state, health and readiness."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel
from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
from kvgate.protocol import step as wire
from kvgate.protocol.tokenizer_files import TokenizerFiles
from kvgate.step_server.server import StepServer

Client = TestClient[web.Request, web.Application]
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = [5, 9, 2, 7]


def _fill_plan(step_id: int, rid: str = "r") -> wire.StepPlan:
    return wire.StepPlan(
        step_id=step_id,
        new_requests=[
            wire.NewRequest(
                request_id=rid, prompt_token_ids=PROMPT, sampling=wire.SamplingParams(max_tokens=4)
            )
        ],
        block_appends=[wire.BlockAppend(request_id=rid, new_block_ids=[[0, 1]])],
        prefill_rows=[
            wire.PrefillRow(
                request_id=rid, token_start=0, token_end=4, depth_first=1, depth_last=1,
                completes_fill=True,
            )
        ],
    )  # fmt: skip


def _decode_plan(step_id: int, rid: str = "r") -> wire.StepPlan:
    return wire.StepPlan(
        step_id=step_id, decode=wire.DecodeRows(request_ids=[rid], positions=[None], depths=[None])
    )


async def _client(
    load: Callable[[], Executor],
) -> tuple[StepServer, Client]:
    server = StepServer(load, TOKEN)
    client = TestClient(TestServer(server.app()))
    await client.start_server()
    return server, client


@pytest.fixture
async def client(llama: LoadedModel) -> AsyncIterator[Client]:
    server, test_client = await _client(lambda: Executor(llama, num_blocks=16, block_size=4))
    await server.wait_loaded()
    yield test_client
    await test_client.close()


async def _open(
    client: Client, epoch: int, version: int = wire.PROTOCOL_VERSION
) -> tuple[aiohttp.ClientWebSocketResponse, dict[str, object]]:
    ws = await client.ws_connect("/v1/steps", headers=AUTH)
    opening = wire.SessionOpen(epoch=epoch, session_id=f"s{epoch}", protocol_version=version)
    await ws.send_str(opening.model_dump_json())
    reply = json.loads(await ws.receive_str(timeout=10))
    return ws, reply


async def _result(ws: aiohttp.ClientWebSocketResponse) -> wire.StepResult:
    return wire.StepResult.model_validate_json(await ws.receive_str(timeout=10))


async def test_health_readiness_and_metrics_follow_loading(llama: LoadedModel) -> None:
    release = threading.Event()

    def slow_load() -> Executor:
        release.wait(timeout=30)
        return Executor(llama, num_blocks=16, block_size=4)

    server, client = await _client(slow_load)
    try:
        assert (await client.get("/healthz")).status == 200
        assert (await client.get("/readyz")).status == 503
        refused = await client.get("/v1/steps", headers=AUTH)
        assert refused.status == 503
        release.set()
        await server.wait_loaded()
        assert (await client.get("/readyz")).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert "kvgate_executor_ready 1.0" in metrics
        assert "kvgate_executor_kv_blocks 16.0" in metrics
    finally:
        release.set()
        await client.close()


async def test_failed_load_is_unhealthy() -> None:
    def broken() -> Executor:
        raise ValueError("no such model")

    server, client = await _client(broken)
    try:
        with pytest.raises(ValueError, match="no such model"):
            await server.wait_loaded()
        health = await client.get("/healthz")
        assert health.status == 503 and "no such model" in await health.text()
        assert (await client.get("/readyz")).status == 503
    finally:
        await client.close()


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
    ],
    ids=["none", "wrong-token", "wrong-scheme", "no-scheme"],
)
async def test_step_socket_requires_the_bearer_token(
    client: Client,
    headers: dict[str, str],
) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await client.ws_connect("/v1/steps", headers=headers)
    assert refused.value.status == 401
    # Health and metrics stay open.
    assert (await client.get("/healthz")).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'kvgate_executor_sessions_total{outcome="unauthorized"} 1.0' in metrics


async def test_session_runs_pipelined_plans_in_order(
    client: Client,
    llama: LoadedModel,
) -> None:
    ws, reply = await _open(client, epoch=1)
    accepted = wire.SessionAccepted.model_validate(reply)
    assert accepted.info.num_blocks == 16 and accepted.info.model_family == "llama"
    # Three plans sent back to back; the decode rows depend on the plans before them.
    for plan in (_fill_plan(1), _decode_plan(2), _decode_plan(3)):
        await ws.send_str(plan.model_dump_json())
    results = [await _result(ws) for _ in range(3)]
    assert [r.step_id for r in results] == [1, 2, 3]
    assert all(r.error is None for r in results)
    positions = [t.position for r in results for t in r.sampled_tokens()]
    assert positions == [4, 5, 6]
    await ws.close()


async def test_newer_epoch_fences_the_older_session(
    client: Client,
) -> None:
    old, reply = await _open(client, epoch=5)
    assert reply["type"] == "accepted"
    await old.send_str(_fill_plan(1).model_dump_json())
    assert (await _result(old)).error is None

    new, reply = await _open(client, epoch=6)
    assert reply["type"] == "accepted"
    fenced = wire.ProtocolError.model_validate_json(await old.receive_str(timeout=10))
    assert fenced.code is wire.ErrorCode.STALE_EPOCH
    assert (await old.receive(timeout=10)).type in {
        aiohttp.WSMsgType.CLOSE,
        aiohttp.WSMsgType.CLOSED,
    }

    # The new epoch starts from nothing: the old session's request is gone.
    await new.send_str(_decode_plan(1).model_dump_json())
    result = await _result(new)
    assert result.error is not None and result.error.code is wire.ErrorCode.UNKNOWN_REQUEST

    for stale_epoch in (6, 4):
        stale, reply = await _open(client, epoch=stale_epoch)
        assert reply["type"] == "error" and reply["code"] == "stale_epoch"
        assert (await stale.receive(timeout=10)).type in {
            aiohttp.WSMsgType.CLOSE,
            aiohttp.WSMsgType.CLOSED,
        }
    # The current session is unaffected by the stale attempts.
    await new.send_str(_fill_plan(2).model_dump_json())
    assert (await _result(new)).error is None
    await new.close()


async def test_bad_plans_get_error_results_and_the_session_goes_on(
    client: Client,
) -> None:
    ws, _ = await _open(client, epoch=1)
    await ws.send_str(_fill_plan(1).model_dump_json())
    assert (await _result(ws)).error is None
    # Structurally invalid (empty token range) but with a step id: a BAD_PLAN result.
    bad = _decode_plan(2).model_dump(mode="json")
    bad["prefill_rows"] = [
        {"request_id": "r", "token_start": 3, "token_end": 3, "depth_first": 1, "depth_last": 1}
    ]
    await ws.send_str(json.dumps(bad))
    # Inconsistent: a decode row for a request that does not exist.
    await ws.send_str(_decode_plan(3, rid="ghost").model_dump_json())
    await ws.send_str(_decode_plan(4).model_dump_json())
    invalid, unknown, good = [await _result(ws) for _ in range(3)]
    assert invalid.step_id == 2 and invalid.error is not None
    assert (
        invalid.error.code is wire.ErrorCode.BAD_PLAN
        and "empty token range" in invalid.error.message
    )
    assert unknown.step_id == 3 and unknown.error is not None
    assert unknown.error.code is wire.ErrorCode.UNKNOWN_REQUEST and "ghost" in unknown.error.message
    assert good.step_id == 4 and good.error is None and good.sampled_tokens()[0].position == 5
    metrics = await (await client.get("/metrics")).text()
    assert 'kvgate_executor_steps_total{outcome="bad_plan"} 1.0' in metrics
    assert 'kvgate_executor_steps_total{outcome="unknown_request"} 1.0' in metrics
    assert 'kvgate_executor_steps_total{outcome="ok"} 2.0' in metrics
    await ws.close()


@pytest.mark.parametrize(
    ("first", "after_open", "message"),
    [
        ("not json at all", False, "first message must be a SessionOpen"),
        (_decode_plan(1).model_dump_json(), False, "first message must be a SessionOpen"),
        (
            json.dumps({"type": "open", "epoch": 1, "session_id": "x", "protocol_version": 99}),
            False,
            "protocol version 99",
        ),
        ("{broken", True, "invalid message"),
        (wire.SessionOpen(epoch=9, session_id="again").model_dump_json(), True, "already open"),
    ],
    ids=["garbage-first", "plan-first", "wrong-version", "garbage-later", "second-open"],
)
async def test_protocol_violations_close_the_session(
    client: Client,
    first: str,
    after_open: bool,
    message: str,
) -> None:
    ws = await client.ws_connect("/v1/steps", headers=AUTH)
    if after_open:
        await ws.send_str(wire.SessionOpen(epoch=1, session_id="s").model_dump_json())
        assert json.loads(await ws.receive_str(timeout=10))["type"] == "accepted"
    await ws.send_str(first)
    error = wire.ProtocolError.model_validate_json(await ws.receive_str(timeout=10))
    assert error.code is wire.ErrorCode.PROTOCOL and message in error.message
    closing = await ws.receive(timeout=10)
    assert closing.type in {aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED}
    await asyncio.wait_for(ws.close(), timeout=10)


async def test_shutdown_closes_the_session_as_going_away(llama: LoadedModel) -> None:
    server, test_client = await _client(lambda: Executor(llama, num_blocks=16, block_size=4))
    await server.wait_loaded()
    ws, reply = await _open(test_client, epoch=1)
    assert reply["type"] == "accepted"
    await test_client.server.close()
    closing = await ws.receive(timeout=10)
    assert closing.type is aiohttp.WSMsgType.CLOSE
    assert closing.data == aiohttp.WSCloseCode.GOING_AWAY
    await test_client.close()


async def test_the_executor_serves_its_models_tokenizer(tmp_path: Path) -> None:
    """What the admission service tokenizes with: the model directory's own tokenizer.json."""
    model_dir = make_tiny_model(tmp_path / "m", TinyModelSpec(seed=3))  # byte tokenizer
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages[0].content }}", "model_max_length": 9})
    )
    server, client = await _client(lambda: Executor(model_dir, num_blocks=16, block_size=4))
    await server.wait_loaded()
    try:
        assert (await client.get("/v1/tokenizer")).status == 401
        response = await client.get("/v1/tokenizer", headers=AUTH)
        assert response.status == 200
        served = TokenizerFiles.model_validate_json(await response.text())
        assert served.tokenizer_json == (model_dir / "tokenizer.json").read_text()
        # The chat settings only: the rest of tokenizer_config.json is the executor's business.
        assert served.tokenizer_config == {"chat_template": "{{ messages[0].content }}"}
    finally:
        await client.close()


async def test_a_model_without_a_tokenizer_serves_none(llama: LoadedModel) -> None:
    bare = LoadedModel(llama.model, None, llama.source)
    server, client = await _client(lambda: Executor(bare, num_blocks=16, block_size=4))
    await server.wait_loaded()
    try:
        response = await client.get("/v1/tokenizer", headers=AUTH)
        assert response.status == 404
        assert "no tokenizer" in await response.text()
    finally:
        await client.close()


async def test_results_come_in_the_openers_protocol_version(client: Client) -> None:
    """Version 1 (an admission service before columns): tokens as objects. Version 2: the same
    tokens as columns. Any other version is refused, naming the ones spoken."""
    seen: dict[int, list[wire.SampledToken]] = {}
    for epoch, version in ((1, 1), (2, 2)):
        ws, reply = await _open(client, epoch=epoch, version=version)
        assert reply["type"] == "accepted"
        raws = []
        for plan in (_fill_plan(1), _decode_plan(2), _decode_plan(3)):
            await ws.send_str(plan.model_dump_json())
            raws.append(json.loads(await ws.receive_str(timeout=10)))
        if version == 1:
            assert all("sampled" not in raw and len(raw["tokens"]) == 1 for raw in raws)
        else:
            assert all(
                raw["tokens"] == [] and len(raw["sampled"]["token_ids"]) == 1 for raw in raws
            )
        results = [wire.StepResult.model_validate(raw) for raw in raws]
        seen[version] = [t for r in results for t in r.sampled_tokens()]
        await ws.close()
    assert [t.position for t in seen[2]] == [4, 5, 6]
    assert seen[1] == seen[2], "the same tokens either way (the session reset between them)"
    ws, reply = await _open(client, epoch=3, version=3)
    assert reply["type"] == "error" and "protocol version 3" in str(reply["message"])
    assert "speaks 1, 2" in str(reply["message"])
