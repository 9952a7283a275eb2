"""A batch run's world without Kafka: a service that answers each request id once (the
admission service's idempotency: a copy of an id in flight or answered is dropped), its reply
partition as a list, and a reader of it that hands answers to a run.

The service's rules are the real one's as docs/admission-service.md states them; the tests of
the real thing (tests/integration/test_batches_kafka.py) check the same properties end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.batch.journal import BatchRecord, FileRecord
from kvgate.batch.lines import LineMapper
from kvgate.batch.objects import BatchStatus, Endpoint
from kvgate.batch.run import BatchRun
from kvgate.batch.settings import BatchSettings, StoreKind, StoreSettings
from kvgate.batch.store import LocalStore, ObjectStore, file_key
from kvgate.gateway.settings import ModelRoute
from kvgate.protocol.enums import FinishReason
from kvgate.protocol.records import (
    InferenceRequest,
    InferenceResult,
    ReplyTo,
    ResultStatus,
    SourceRef,
    Timings,
    Usage,
)

MODEL = "sim"
ROUTE = ModelRoute(name=MODEL)
BATCH_ID = "batch_" + "0" * 24
FILE_ID = "file-" + "1" * 24
NOW = 1_800_000_000


def settings(tmp: Path, **changes: object) -> BatchSettings:
    base = BatchSettings(
        store=StoreSettings(kind=StoreKind.LOCAL, path=tmp), window=4, segment_lines=5,
        segment_age_s=3600, abort_grace_s=0.5,
    )  # fmt: skip
    return base.model_copy(update=changes)


def chat_line(i: int, **body: object) -> bytes:
    line = {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}], **body},
    }
    return json.dumps(line).encode() + b"\n"


def record(**changes: object) -> BatchRecord:
    base = BatchRecord(
        id=BATCH_ID, owner="team", endpoint=Endpoint.CHAT, input_file_id=FILE_ID,
        completion_window="24h", priority=100, status=BatchStatus.VALIDATING, created_at=NOW,
        expires_at=NOW + 86_400,
    )  # fmt: skip
    return base.model_copy(update=changes)


async def write_input(store: ObjectStore, data: bytes) -> None:
    async def one() -> object:
        yield data

    await store.put(file_key(FILE_ID), one())  # type: ignore[arg-type]


def answer(request: InferenceRequest, offset: int, status: ResultStatus) -> InferenceResult:
    finish = FinishReason.LENGTH if status is ResultStatus.COMPLETED else FinishReason.ABORT
    return InferenceResult(
        request_id=request.request_id, status=status, finish_reason=finish,
        output_token_ids=[7, 8], text=f"answer to {request.request_id}",
        usage=Usage(prompt_tokens=3, completion_tokens=2), timings=Timings(end_to_end_s=0.1),
        source=SourceRef(topic="kvgate.requests", partition=0, offset=offset),
    )  # fmt: skip


@dataclass
class FakeService:
    """Runs what it is sent, one id once; ``step()`` answers what is running (by id order)."""

    replies: list[InferenceResult] = field(default_factory=list)  # the reply partition
    received: list[str] = field(default_factory=list)  # every copy sent, in order
    ran: Counter[str] = field(default_factory=Counter)
    running: dict[str, InferenceRequest] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    answered: set[str] = field(default_factory=set)
    new_reply: asyncio.Event = field(default_factory=asyncio.Event)
    auto: bool = True  # answer every request as it arrives

    def receive(self, request: InferenceRequest) -> None:
        rid = request.request_id
        self.received.append(rid)
        if rid in self.running or rid in self.answered:
            return  # a duplicate: dead-lettered, no answer (idempotency)
        self.ran[rid] += 1
        self.running[rid] = request
        if rid in self.aborted or self.auto:
            self.step()

    def abort(self, request_ids: Sequence[str]) -> None:
        self.aborted.update(request_ids)
        for rid in request_ids:
            if rid in self.running:
                self._answer(rid, ResultStatus.ABORTED)

    def step(self, count: int | None = None) -> None:
        for rid in sorted(self.running)[:count]:
            status = ResultStatus.ABORTED if rid in self.aborted else ResultStatus.COMPLETED
            self._answer(rid, status)

    def _answer(self, rid: str, status: ResultStatus) -> None:
        request = self.running.pop(rid)
        self.answered.add(rid)
        self.replies.append(answer(request, len(self.received), status))
        self.new_reply.set()


class FakePorts:
    """``RunPorts`` over a FakeService; a reader task hands replies from ``start`` on."""

    def __init__(self, store: ObjectStore, service: FakeService, start: int | None) -> None:
        self._store = store
        self.service = service
        self.published: list[BatchRecord] = []
        self.files: list[FileRecord] = []
        self.position = len(service.replies) if start is None else start
        self._caught_up_at = len(service.replies)
        self._caught_up = asyncio.Event()
        self.run: BatchRun | None = None
        self.fail_publish_after: int | None = None  # raise on this many publishes (a crash)

    @property
    def store(self) -> ObjectStore:
        return self._store

    async def send(self, route: ModelRoute, request: InferenceRequest) -> None:
        self.service.receive(request)

    async def abort(self, request_ids: Sequence[str]) -> None:
        self.service.abort(request_ids)

    async def publish(self, record: BatchRecord) -> None:
        if self.fail_publish_after is not None and len(self.published) >= self.fail_publish_after:
            raise ConnectionError("the broker went away (a crash, for the test)")
        self.published.append(record)

    async def add_file(self, record: FileRecord) -> None:
        self.files.append(record)

    def reply_position(self) -> int:
        return self.position

    async def replies_caught_up(self) -> None:
        await self._caught_up.wait()

    async def read_replies(self) -> None:
        """Hand every reply from ``position`` on to the run (the feeder's ReplyReader)."""
        while True:
            while self.position < len(self.service.replies):
                result = self.service.replies[self.position]
                index = int(result.request_id.rpartition(":")[2])
                assert self.run is not None
                self.run.on_answer(index, result, self.position)
                self.position += 1
            if self.position >= self._caught_up_at:
                self._caught_up.set()
            self.service.new_reply.clear()
            await self.service.new_reply.wait()


def mapper(batch: BatchRecord) -> LineMapper:
    return LineMapper(
        batch, routes={MODEL: ROUTE}, codecs={MODEL: None}, default_max_tokens=16,
        reply=ReplyTo(topic="kvgate.replies.batches", partition=0),
    )  # fmt: skip


async def run_batch(
    store: ObjectStore,
    service: FakeService,
    batch: BatchRecord,
    config: BatchSettings,
    *,
    epoch: int = 1,
    clock: object = None,
    fail_publish_after: int | None = None,
    until: object = None,
) -> tuple[BatchRun, FakePorts, BaseException | None]:
    """Run ``batch`` to its end (or until it raises: the crash a test set up)."""
    ports = FakePorts(store, service, batch.checkpoint.results_from)
    ports.fail_publish_after = fail_publish_after
    run = BatchRun(
        batch, epoch=epoch, ports=ports, mapper=mapper(batch), settings=config,
        clock=clock or (lambda: float(NOW)),  # type: ignore[arg-type]
    )  # fmt: skip
    ports.run = run
    reader = asyncio.create_task(ports.read_replies())
    failure: BaseException | None = None
    try:
        await asyncio.wait_for(run.run(), 30)
    except (ConnectionError, AssertionError) as exc:
        failure = exc
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    return run, ports, failure


def local_store(tmp: Path) -> LocalStore:
    return LocalStore(tmp)
