"""One batch run against a service that answers each id once (tests/batch/fakes.py): every
line answered exactly once and in input order, the window, restarts at every checkpoint,
cancel, expiry, malformed lines and validation failures."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvgate.batch.ids import line_request_id
from kvgate.batch.objects import BatchStatus
from kvgate.batch.run import BatchRun
from kvgate.batch.store import file_key, read_all, segment_prefix
from tests.batch.fakes import (
    BATCH_ID,
    NOW,
    FakePorts,
    FakeService,
    chat_line,
    local_store,
    mapper,
    record,
    run_batch,
    settings,
    write_input,
)

MALFORMED = [
    b"\n",  # blank: no line at all
    b"{not json\n",
    json.dumps(
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}
    ).encode()
    + b"\n",
    chat_line(900, temperature=9),  # the door refuses it (temperature above 2)
    chat_line(901, model="nobody"),  # no such model
    chat_line(902, stream=True),  # a batch line is not streamed
]


def _input(count: int, *, malformed: bool = False) -> tuple[bytes, list[str], list[str | None]]:
    """The file, the custom ids that should answer, and those that should fail (in order)."""
    lines = [chat_line(i) for i in range(count)]
    good = [f"req-{i}" for i in range(count)]
    bad: list[str | None] = []
    if malformed:
        for at, extra in zip((1, 3, 6, 8, 11, 12), MALFORMED, strict=True):
            lines.insert(at, extra)
        bad = [None, "bad-url", "req-900", "req-901", "req-902"]  # the blank line is no line
    return b"".join(lines), good, bad


async def _file_lines(ports: FakePorts, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    data = await read_all(ports.store, file_key(file_id))
    return [json.loads(line) for line in data.splitlines()]


async def test_every_line_is_answered_once_in_input_order_and_malformed_lines_fail_alone(
    tmp_path: Path,
) -> None:
    store, service, config = local_store(tmp_path), FakeService(), settings(tmp_path)
    data, good, bad = _input(17, malformed=True)
    await write_input(store, data)
    run, ports, failure = await run_batch(store, service, record(), config)
    assert failure is None
    final = run.record
    assert final.status is BatchStatus.COMPLETED
    assert [r.status for r in ports.published][:2] == [BatchStatus.IN_PROGRESS] * 2
    assert [r.status for r in ports.published][-2:] == [
        BatchStatus.FINALIZING, BatchStatus.COMPLETED,
    ]  # fmt: skip
    output = await _file_lines(ports, final.output_file_id)
    errors = await _file_lines(ports, final.error_file_id)
    assert [o["custom_id"] for o in output] == good  # input order
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)
    assert output[0]["response"]["body"]["choices"][0]["message"]["content"].startswith("answer")
    assert [e["custom_id"] for e in errors] == bad
    codes = [(e["error"] or {}).get("code") or e["response"]["status_code"] for e in errors]
    assert codes == ["invalid_json", "invalid_url", 400, 404, 400]
    assert final.total == len(good) + len(bad)
    counts = final.api()["request_counts"]
    assert counts == {"total": 22, "completed": 17, "failed": 5}
    assert final.api()["usage"]["total_tokens"] == 17 * 5
    # Each line's request id ran once, and was sent once (nothing to resend without a crash).
    assert sorted(service.ran.values()) == [1] * 17 and len(service.received) == 17
    assert await store.keys(segment_prefix(BATCH_ID)) == []


async def test_lines_go_at_the_batch_class_with_derived_ids_and_the_batch_deadline(
    tmp_path: Path,
) -> None:
    store, service, config = local_store(tmp_path), FakeService(), settings(tmp_path)
    lines = [chat_line(0), chat_line(1, priority=500), chat_line(2, priority=3)]
    await write_input(store, b"".join(lines))
    requests = []
    original = service.receive
    service.receive = lambda request: (requests.append(request), original(request))  # type: ignore[method-assign]
    run, _, _ = await run_batch(store, service, record(), config)
    assert run.record.status is BatchStatus.COMPLETED
    assert [r.request_id for r in requests] == [line_request_id(BATCH_ID, i) for i in range(3)]
    # The batch class; a line may ask to be less important (500), never more (3 -> 100).
    assert [r.priority for r in requests] == [100, 500, 100]
    assert {r.deadline_unix_s for r in requests} == {float(NOW + 86_400)}
    assert all(r.reply is not None and not r.reply.tokens for r in requests)


async def test_the_window_bounds_lines_in_flight_and_only_answers_release_more(
    tmp_path: Path,
) -> None:
    store, config = local_store(tmp_path), settings(tmp_path, window=3)
    service = FakeService(auto=False)
    data, good, _ = _input(12)
    await write_input(store, data)
    batch = record()
    ports = FakePorts(store, service, None)
    run = BatchRun(
        batch, epoch=1, ports=ports, mapper=mapper(batch), settings=config, clock=lambda: NOW
    )
    ports.run = run
    reader = asyncio.create_task(ports.read_replies())
    task = asyncio.create_task(run.run())
    await _until(lambda: len(service.received) == 3)
    for _ in range(50):  # no answer: nothing more is sent, however long it waits
        await asyncio.sleep(0)
    assert len(service.received) == 3
    most = 0
    while not task.done():
        most = max(most, len(service.running))
        service.step(1)
        await asyncio.sleep(0.001)
    reader.cancel()
    assert (await task).status is BatchStatus.COMPLETED
    assert most <= 3
    output = await _file_lines(ports, run.record.output_file_id)
    assert [o["custom_id"] for o in output] == good


@pytest.mark.parametrize("crash_at_publish", range(2, 9))  # 9 writes in all
async def test_a_restart_mid_batch_answers_every_line_exactly_once(
    tmp_path: Path, crash_at_publish: int
) -> None:
    """The first owner crashes on its n-th write of the batch's state, with lines in flight
    and answers not yet written; the next owner resumes from the last state it wrote."""
    store, config = local_store(tmp_path), settings(tmp_path)
    service = FakeService(auto=False)
    data, good, _ = _input(23)
    await write_input(store, data)

    async def answer_some() -> None:  # answers trickle in, in id order, some left running
        while True:
            await asyncio.sleep(0.001)
            service.step(1)

    stepping = asyncio.create_task(answer_some())
    _, ports, failure = await run_batch(
        store, service, record(), config, fail_publish_after=crash_at_publish
    )
    stepping.cancel()
    assert isinstance(failure, ConnectionError)
    durable = ports.published[-1]
    assert durable.status in (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING)
    service.auto = True
    service.step()  # what was left running is answered while nobody owns the batch
    second, ports2, failure2 = await run_batch(store, service, durable, config, epoch=2)
    assert failure2 is None and second.record.status is BatchStatus.COMPLETED
    output = await _file_lines(ports2, second.record.output_file_id)
    assert [o["custom_id"] for o in output] == good  # each line once, in order
    assert second.record.error_file_id is None
    assert sorted(service.ran.values()) == [1] * 23  # the service ran every id once
    assert {r.epoch for r in ports2.published} == {2}
    assert await store.keys(segment_prefix(BATCH_ID)) == []  # orphan segments too


async def test_a_cancel_aborts_what_is_in_flight_and_finalizes_the_rest(tmp_path: Path) -> None:
    store, config = local_store(tmp_path), settings(tmp_path, window=4)
    service = FakeService(auto=False)
    data, good, _ = _input(20)
    await write_input(store, data)
    batch = record()
    ports = FakePorts(store, service, None)
    run = BatchRun(
        batch, epoch=1, ports=ports, mapper=mapper(batch), settings=config, clock=lambda: NOW
    )
    ports.run = run
    reader = asyncio.create_task(ports.read_replies())
    task = asyncio.create_task(run.run())
    await _until(lambda: len(service.received) == 4)
    service.step(2)  # two lines answered before the cancel
    await _until(lambda: len(service.received) == 6)
    run.cancel()
    final = await asyncio.wait_for(task, 10)
    reader.cancel()
    assert final.status is BatchStatus.CANCELLED
    assert BatchStatus.CANCELLING in [r.status for r in ports.published]
    output = await _file_lines(ports, final.output_file_id)
    errors = await _file_lines(ports, final.error_file_id)
    assert [o["custom_id"] for o in output] == good[:2]
    assert [e["custom_id"] for e in errors] == good[2:]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert service.aborted >= {line_request_id(BATCH_ID, i) for i in range(2, 6)}
    assert final.api()["request_counts"] == {"total": 20, "completed": 2, "failed": 18}


async def test_expiry_gives_up_the_rest_as_expired(tmp_path: Path) -> None:
    store, config = local_store(tmp_path), settings(tmp_path, window=2)
    service = FakeService(auto=False)
    data, good, _ = _input(8)
    await write_input(store, data)
    now = [float(NOW)]
    batch = record(expires_at=NOW + 60)
    ports = FakePorts(store, service, None)
    run = BatchRun(
        batch, epoch=1, ports=ports, mapper=mapper(batch), settings=config, clock=lambda: now[0]
    )
    ports.run = run
    reader = asyncio.create_task(ports.read_replies())
    task = asyncio.create_task(run.run())
    await _until(lambda: len(service.received) == 2)
    service.step(1)
    await _until(lambda: len(service.received) == 3)
    now[0] = NOW + 61.0  # past expires_at: the run sees it at its next step (an answer)
    service.step(1)
    final = await asyncio.wait_for(task, 10)
    reader.cancel()
    assert final.status is BatchStatus.EXPIRED and final.expired_at == NOW + 61
    output = await _file_lines(ports, final.output_file_id)
    errors = await _file_lines(ports, final.error_file_id)
    assert [o["custom_id"] for o in output] == good[:2]
    assert [e["custom_id"] for e in errors] == good[2:]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}


@pytest.mark.parametrize(
    ("data", "code", "line"),
    [
        (chat_line(1) + chat_line(2) + chat_line(1), "duplicate_custom_id", 3),
        (b"\n\n  \n", "empty_file", None),
        (None, "file_not_found", None),
    ],
)
async def test_a_file_that_cannot_run_fails_the_batch(
    tmp_path: Path, data: bytes | None, code: str, line: int | None
) -> None:
    store, service, config = local_store(tmp_path), FakeService(), settings(tmp_path)
    if data is not None:
        await write_input(store, data)
    run, _, failure = await run_batch(store, service, record(), config)
    assert failure is None
    assert run.record.status is BatchStatus.FAILED
    errors = run.record.errors or []
    assert [(e.code, e.line) for e in errors] == [(code, line)]
    assert service.received == []


async def test_a_file_over_the_line_limit_fails_validation(tmp_path: Path) -> None:
    store, service = local_store(tmp_path), FakeService()
    config = settings(tmp_path, max_file_lines=5)
    await write_input(store, b"".join(chat_line(i) for i in range(6)))
    run, _, _ = await run_batch(store, service, record(), config)
    assert run.record.status is BatchStatus.FAILED
    assert [e.code for e in run.record.errors or []] == ["too_many_requests"]


async def _until(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)
