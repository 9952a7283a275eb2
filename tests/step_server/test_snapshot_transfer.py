"""KV snapshot transfer: the frame codec's checks, and the step server's two endpoints.

Over real HTTP between two step servers with simulated backends: an export under a ticket is
fetched once by the receiver (authenticated), staged, adopted by a plan and restored by swap-in,
and decoding continues with the outputs of a run that never moved. Refused with a clear reason:
no token, an unknown ticket, a snapshot over the size limit, a layout other than the
receiver's; the codec refuses a chunk whose checksum does not match and a truncated stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvgate.protocol import migration
from kvgate.protocol import step as wire
from kvgate.protocol.migration import (
    SnapshotLayout,
    SnapshotStaged,
    TransferError,
    TransferFailure,
    TransferRefusal,
)
from kvgate.sim.backend import SimBackend, SimExecutorConfig
from kvgate.step_server.server import StepServer
from kvgate.step_server.snapshots import MigrationLimits

pytestmark = pytest.mark.timeout(60)

TOKEN = "snapshot-transfer-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TICKET = "t" * 24
LAYOUT = SnapshotLayout(
    model_fingerprint="m", block_size=4, num_planes=1, dtype="int64", num_layers=1,
    num_kv_heads=1, head_dim=1,
)  # fmt: skip


def _snapshot(payload: bytes = bytes(range(256)) * 3) -> tuple[migration.SnapshotHeader, bytes]:
    return migration.header(LAYOUT, "r", 2, {"k": 1}, payload), payload


# ---------------------------------------------------------------------------------- the codec


def test_frames_round_trip_in_any_split() -> None:
    header, payload = _snapshot()
    data = b"".join(migration.encode(header, payload, chunk_bytes=100))
    decoder = migration.FrameDecoder(max_bytes=len(data), layout=LAYOUT)
    for start in range(0, len(data), 7):
        decoder.feed(data[start : start + 7])
    assert decoder.result() == (header, payload)


def test_a_corrupted_chunk_fails_its_checksum() -> None:
    header, payload = _snapshot()
    frames = list(migration.encode(header, payload, chunk_bytes=100))
    broken = bytearray(frames[2])
    broken[-5] ^= 0x40
    frames[2] = bytes(broken)
    with pytest.raises(TransferError) as caught:
        migration.decode(b"".join(frames), max_bytes=1 << 20, layout=LAYOUT)
    assert caught.value.failure is TransferFailure.CHECKSUM
    assert "frame 2" in caught.value.message


def test_the_size_limit_is_enforced_before_the_payload_arrives() -> None:
    header, payload = _snapshot()
    frames = list(migration.encode(header, payload, chunk_bytes=100))
    decoder = migration.FrameDecoder(max_bytes=len(payload) // 2)
    with pytest.raises(TransferError) as caught:
        decoder.feed(frames[0])  # the header alone announces too many bytes
    assert caught.value.failure is TransferFailure.TOO_LARGE


def test_a_layout_mismatch_is_refused_naming_the_field() -> None:
    header, payload = _snapshot()
    other = LAYOUT.model_copy(update={"block_size": 8})
    with pytest.raises(TransferError) as caught:
        migration.decode(b"".join(migration.encode(header, payload, 64)), max_bytes=1 << 20,
                         layout=other)  # fmt: skip
    assert caught.value.failure is TransferFailure.LAYOUT_MISMATCH
    assert "block_size is 4 in the snapshot, 8 here" in caught.value.message


def test_a_truncated_stream_is_refused() -> None:
    header, payload = _snapshot()
    data = b"".join(migration.encode(header, payload, 100))
    with pytest.raises(TransferError) as caught:
        migration.decode(data[:-10], max_bytes=1 << 20, layout=LAYOUT)
    assert caught.value.failure is TransferFailure.MALFORMED


def test_the_endpoint_maps_to_the_executors_http_base() -> None:
    assert migration.http_base("ws://10.0.0.7:8000/v1/steps") == "http://10.0.0.7:8000"
    assert migration.http_base("wss://e.example/v1/steps") == "https://e.example"


# ------------------------------------------------------------------------ the HTTP endpoints

CONFIG = SimExecutorConfig(num_blocks=64, block_size=4, host_snapshot_blocks=64)
REQUEST = wire.NewRequest(
    request_id="q",
    prompt_token_ids=[5, 6, 7, 8, 9, 10, 11],
    sampling=wire.SamplingParams(max_tokens=12, ignore_eos=True, seed=3),
)


@dataclass
class Executor:
    backend: SimBackend
    server: TestServer

    @property
    def base(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


async def _start(config: SimExecutorConfig, limits: MigrationLimits | None = None) -> Executor:
    backend = SimBackend(config)
    server = TestServer(StepServer(lambda: backend, TOKEN, migration=limits).app())
    await server.start_server()
    return Executor(backend, server)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Executor, Executor]]:
    sender, receiver = await _start(CONFIG), await _start(CONFIG)
    try:
        yield sender, receiver
    finally:
        await sender.server.close()
        await receiver.server.close()


def _run(backend: SimBackend, step: int, **fields: object) -> wire.StepResult:
    result = backend.execute(wire.StepPlan(step_id=step, **fields))  # type: ignore[arg-type]
    assert result.error is None, result.error
    return result


def _decode(backend: SimBackend, step: int) -> int:
    result = _run(backend, step, decode=wire.DecodeRows(request_ids=["q"], positions=[None],
                                                        depths=[None]))  # fmt: skip
    return result.sampled_tokens()[0].token_id


def _start_request(backend: SimBackend) -> list[int]:
    """Prefill and three decodes of ``q`` (pages 0..4); the tokens so far."""
    pages = [[0, 1, 2, 3, 4]]
    first = _run(
        backend,
        1,
        new_requests=[REQUEST],
        block_appends=[wire.BlockAppend(request_id="q", new_block_ids=pages)],
        prefill_rows=[wire.PrefillRow(request_id="q", token_start=0, token_end=7, depth_first=1,
                                      depth_last=1, completes_fill=True)],
    )  # fmt: skip
    return [first.sampled_tokens()[0].token_id] + [_decode(backend, step) for step in (2, 3, 4)]


def _export(sender: SimBackend) -> None:
    _run(sender, 5, export=[wire.SnapshotExport(request_id="q", ticket=TICKET, ttl_s=30)])


async def _import(
    receiver: Executor, source: str, headers: dict[str, str] = AUTH, ticket: str = TICKET
) -> tuple[int, str]:
    body = migration.SnapshotImport(source=source, ticket=ticket, request_id="q")
    async with (
        aiohttp.ClientSession() as http,
        http.post(receiver.base + migration.IMPORT_PATH, data=body.model_dump_json(),
                  headers=headers) as response,
    ):  # fmt: skip
        return response.status, await response.text()


def _failure(text: str) -> TransferFailure:
    return TransferRefusal.model_validate_json(text).failure


async def test_export_fetch_adopt_and_decode_continues_as_if_it_never_moved(
    pair: tuple[Executor, Executor],
) -> None:
    sender, receiver = pair
    reference = SimBackend(CONFIG)
    expected = _start_request(reference) + [_decode(reference, s) for s in range(5, 13)]

    tokens = _start_request(sender.backend)
    _export(sender.backend)
    assert sender.backend.counters.num_exports == 1 and sender.backend.counters.num_requests == 0
    status, text = await _import(receiver, sender.base)
    assert status == 200, text
    staged = SnapshotStaged.model_validate_json(text)
    assert (staged.num_pages, staged.num_blocks) == (5, 5)
    assert sender.backend.counters.num_exports == 0, "a ticket is good for one fetch"
    assert receiver.backend.counters.num_staged == 1
    # Different block ids on the receiver: the KV moved, not the numbering.
    _run(
        receiver.backend,
        1,
        adopt=[wire.SnapshotAdopt(request_id="q", ticket=TICKET)],
        swap_in=[wire.SwapIn(request_id="q", block_ids=[[40, 33, 12, 9, 50]])],
    )
    tokens += [_decode(receiver.backend, s) for s in range(2, 10)]
    assert tokens == expected
    # The same ticket again: gone.
    status, text = await _import(receiver, sender.base)
    assert status == 404 and _failure(text) is TransferFailure.NOT_FOUND


async def test_both_endpoints_refuse_without_the_token(pair: tuple[Executor, Executor]) -> None:
    sender, receiver = pair
    _start_request(sender.backend)
    _export(sender.backend)
    async with aiohttp.ClientSession() as http:
        url = f"{sender.base}{migration.SNAPSHOTS_PATH}/{TICKET}"
        async with http.get(url) as response:
            assert response.status == 401
        async with http.get(url, headers={"Authorization": "Bearer wrong"}) as response:
            assert response.status == 401
    status, text = await _import(receiver, sender.base, headers={})
    assert status == 401 and _failure(text) is TransferFailure.UNAUTHORIZED
    assert sender.backend.counters.num_exports == 1, "a refused fetch takes nothing"


async def test_an_unknown_ticket_is_not_found(pair: tuple[Executor, Executor]) -> None:
    sender, receiver = pair
    status, text = await _import(receiver, sender.base, ticket="x" * 24)
    assert status == 404 and _failure(text) is TransferFailure.NOT_FOUND


async def test_a_snapshot_over_the_receivers_limit_is_refused() -> None:
    sender, receiver = (
        await _start(CONFIG),
        await _start(CONFIG, MigrationLimits(max_snapshot_bytes=300)),
    )
    try:
        _start_request(sender.backend)
        _export(sender.backend)
        status, text = await _import(receiver, sender.base)
        assert status == 413 and _failure(text) is TransferFailure.TOO_LARGE
        assert receiver.backend.counters.num_staged == 0
    finally:
        await sender.server.close()
        await receiver.server.close()


async def test_a_receiver_of_another_model_refuses_the_layout() -> None:
    other = CONFIG.model_copy(update={"seed": 99})
    sender, receiver = await _start(CONFIG), await _start(other)
    try:
        _start_request(sender.backend)
        _export(sender.backend)
        status, text = await _import(receiver, sender.base)
        assert status == 409 and _failure(text) is TransferFailure.LAYOUT_MISMATCH
        assert "model_fingerprint" in TransferRefusal.model_validate_json(text).message
    finally:
        await sender.server.close()
        await receiver.server.close()


async def test_an_unreachable_sender_is_reported_gone(pair: tuple[Executor, Executor]) -> None:
    _sender, receiver = pair
    status, text = await _import(receiver, "http://127.0.0.1:9")
    assert status == 502 and _failure(text) is TransferFailure.SENDER_GONE


def test_adopting_needs_a_staged_snapshot_and_host_room() -> None:
    backend = SimBackend(CONFIG.model_copy(update={"host_snapshot_blocks": 2}))
    result = backend.execute(
        wire.StepPlan(step_id=1, adopt=[wire.SnapshotAdopt(request_id="q", ticket=TICKET)])
    )
    assert result.error is not None and result.error.code is wire.ErrorCode.MISSING_SNAPSHOT
    source = SimBackend(CONFIG)
    _start_request(source)
    _export(source)
    taken = source.take_export(TICKET)
    assert taken is not None
    backend.stage_import(TICKET, *taken)
    result = backend.execute(
        wire.StepPlan(step_id=1, adopt=[wire.SnapshotAdopt(request_id="q", ticket=TICKET)])
    )
    assert result.error is not None and result.error.code is wire.ErrorCode.HOST_BUDGET_EXCEEDED
    assert backend.counters.num_staged == 1, "a refused plan changes nothing"


def test_an_export_mid_fill_is_refused() -> None:
    backend = SimBackend(CONFIG)
    _run(
        backend,
        1,
        new_requests=[REQUEST],
        block_appends=[wire.BlockAppend(request_id="q", new_block_ids=[[0, 1]])],
        prefill_rows=[wire.PrefillRow(request_id="q", token_start=0, token_end=4, depth_first=1,
                                      depth_last=1)],
    )  # fmt: skip
    result = backend.execute(
        wire.StepPlan(step_id=2, export=[wire.SnapshotExport(request_id="q", ticket=TICKET)])
    )
    assert result.error is not None and "token boundary" in result.error.message
