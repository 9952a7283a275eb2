"""The outbox's commit cycles against a scripted producer: what goes into one transaction, what
a failed or cancelled cycle leaves behind (nothing committed, nothing lost, no open
transaction), and the plain mode's acknowledge-then-commit order."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError
from aiokafka.structs import OffsetAndMetadata

from kvgate.admission_service.dead_letters import dead_letter_copy, record_bytes
from kvgate.admission_service.idempotency import AnsweredIds
from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.admission_service.offsets import PartitionLedger, decode_metadata
from kvgate.admission_service.outbox import COMMIT_RETRY_MAX_S, Outbox
from kvgate.admission_service.settings import KafkaSettings
from kvgate.admission_service.validation import RawRecord, Rejection
from kvgate.protocol.records import (
    DeadLetter,
    InferenceResult,
    RejectCode,
    ResultStatus,
    SourceRef,
    Timings,
    Usage,
)

pytestmark = pytest.mark.timeout(30)
KAFKA = KafkaSettings(
    bootstrap_servers="k:1", request_topic="req", result_topic="res", dlq_topic="dlq"
)
DLQ_ROOM = 64 * 1024


@dataclass
class Metadata:
    offset: int


@dataclass
class ScriptedProducer:
    """Records calls; ``commit_gate`` (when set) holds commit_transaction until it is set."""

    log: list[tuple[str, Any]] = field(default_factory=list)
    next_offset: int = 100
    fail_commit: bool = False
    refuse: Callable[[str, bytes | None], BaseException | None] = lambda _topic, _value: None
    commit_gate: asyncio.Event | None = None
    committing: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> None:
        self.log.append(("start", None))

    async def stop(self) -> None:
        self.log.append(("stop", None))

    async def begin_transaction(self) -> None:
        self.log.append(("begin", None))

    async def send(self, topic: str, value: bytes | None, **kw: Any) -> asyncio.Future[Metadata]:
        refused = self.refuse(topic, value)
        if refused is not None:
            self.log.append(("refused", (topic, kw["key"])))
            raise refused
        future: asyncio.Future[Metadata] = asyncio.get_running_loop().create_future()
        future.set_result(Metadata(self.next_offset))
        self.next_offset += 1
        self.log.append(("send", (topic, kw["partition"], kw["key"])))
        return future

    async def send_offsets_to_transaction(self, offsets: dict[Any, Any], group: str) -> None:
        self.log.append(("offsets", {tp.partition: v for tp, v in offsets.items()}))

    async def commit_transaction(self) -> None:
        self.committing.set()
        if self.commit_gate is not None:
            await self.commit_gate.wait()
        if self.fail_commit:
            raise KafkaTimeoutError()
        self.log.append(("commit", None))

    async def abort_transaction(self) -> None:
        self.log.append(("abort", None))


def result(request_id: str, offset: int, partition: int = 0) -> InferenceResult:
    return InferenceResult(
        request_id=request_id,
        status=ResultStatus.COMPLETED,
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        timings=Timings(end_to_end_s=0.1),
        source=SourceRef(topic="req", partition=partition, offset=offset),
    )


class Clock:
    """The outbox's clock, moved by the test: retries wait out their backoff on it."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def past_any_backoff(self) -> None:
        self.now_s += COMMIT_RETRY_MAX_S


def outbox(
    producer: ScriptedProducer,
    *,
    transactional: bool,
    commits: list[Any] | None = None,
    clock: Clock | None = None,
) -> Outbox:
    async def commit_offsets(offsets: dict[Any, OffsetAndMetadata]) -> None:
        assert commits is not None
        commits.append({tp.partition: (o.offset, o.metadata) for tp, o in offsets.items()})

    factory: Callable[[str | None], Any] = lambda _txn_id: producer  # noqa: E731
    return Outbox(
        KAFKA,
        transactional=transactional,
        producer_factory=factory,
        commit_offsets=commit_offsets,
        metrics=ServiceMetrics(),
        dead_letter_max_bytes=DLQ_ROOM,
        clock=clock or Clock(),
    )


async def test_one_transaction_carries_answers_and_the_commit_point() -> None:
    producer = ScriptedProducer()
    box = outbox(producer, transactional=True)
    await box.open_partition(0)
    box.track(0, PartitionLedger(committed=0, results_end=100))
    for offset in range(3):
        assert not box.read(0, offset)
    box.answer(result("a", 1), None)  # offset 1 done, 0 and 2 still running
    await box.flush()
    kinds = [kind for kind, _ in producer.log]
    assert kinds == ["start", "begin", "send", "offsets", "commit"]
    offsets = dict(producer.log)["offsets"]
    commit_offset, metadata = offsets[0]
    assert commit_offset == 0, "offset 0 is still running: nothing past it is committed"
    assert decode_metadata(metadata) == 100, "the answer to 1 is findable from results 100"


async def test_a_failed_commit_aborts_and_keeps_the_answers_for_the_next_cycle() -> None:
    producer = ScriptedProducer(fail_commit=True)
    clock = Clock()
    box = outbox(producer, transactional=True, clock=clock)
    await box.open_partition(0)
    box.track(0, PartitionLedger(committed=0))
    box.read(0, 0)
    box.answer(result("a", 0), None)
    await box.flush()
    assert [k for k, _ in producer.log][-1] == "abort"
    producer.fail_commit = False
    producer.log.clear()
    clock.past_any_backoff()
    await box.flush()
    assert [k for k, _ in producer.log] == ["begin", "send", "offsets", "commit"]
    assert dict(producer.log)["offsets"][0][0] == 1


async def test_a_failing_partition_backs_off_with_jitter_and_closing_still_tries() -> None:
    producer = ScriptedProducer(fail_commit=True)
    clock = Clock()
    box = outbox(producer, transactional=True, clock=clock)
    await box.open_partition(0)
    box.track(0, PartitionLedger(committed=0))
    box.read(0, 0)
    box.answer(result("a", 0), None)
    interval_s = KAFKA.commit_interval_ms / 1000
    tick_s = interval_s / 8

    def attempts() -> int:
        return [kind for kind, _ in producer.log].count("begin")

    await box.flush()
    waits: list[float] = []
    for failures in range(1, 8):
        assert attempts() == failures
        began = clock.now_s
        # Regular cycles skip the partition until its delay has passed, then one tries again.
        while attempts() == failures:
            clock.now_s += tick_s
            await box.flush()
        waits.append(clock.now_s - began)
    ceilings = [min(COMMIT_RETRY_MAX_S, interval_s * 2**n) for n in range(7)]
    for wait, ceiling in zip(waits, ceilings, strict=True):
        assert ceiling / 2 <= wait <= ceiling + tick_s, (waits, ceilings)
    # Revocation does not wait out the backoff: its last cycle runs at once.
    producer.fail_commit = False
    before = attempts()
    assert await box.close_partition(0) == 0
    assert attempts() == before + 1 and producer.log[-2] == ("commit", None)


async def test_a_cancelled_cycle_leaves_no_open_transaction_and_loses_nothing() -> None:
    gate = asyncio.Event()
    producer = ScriptedProducer(commit_gate=gate)
    box = outbox(producer, transactional=True)
    await box.open_partition(0)
    box.track(0, PartitionLedger(committed=0))
    box.read(0, 0)
    box.answer(result("a", 0), None)
    cycle = asyncio.create_task(box.flush())
    await producer.committing.wait()  # the transaction holds answers and offsets, uncommitted
    cycle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cycle
    assert producer.log[-1] == ("abort", None)
    producer.commit_gate = None
    producer.log.clear()
    await box.flush()  # the answer goes out again, in a fresh transaction
    assert [k for k, _ in producer.log] == ["begin", "send", "offsets", "commit"]


async def test_plain_mode_commits_offsets_only_after_the_acks() -> None:
    producer = ScriptedProducer()
    commits: list[Any] = []
    box = outbox(producer, transactional=False, commits=commits)
    await box.start()
    box.track(0, PartitionLedger(committed=0))
    box.track(1, PartitionLedger(committed=5))
    box.read(0, 0)
    box.read(1, 5)
    box.answer(result("a", 0), None)
    box.answer(result("b", 5, partition=1), None)
    await box.flush()
    assert [k for k, _ in producer.log] == ["start", "send", "send"]
    assert commits == [{0: (1, "kvgate/1 results_from=101"), 1: (6, "kvgate/1 results_from=102")}]
    sends = [v for k, v in producer.log if k == "send"]
    assert sends == [("res", 0, b"a"), ("res", 1, b"b")], "results go to the request's partition"


def bad_record(offset: int, value: bytes) -> tuple[RawRecord, Rejection]:
    record = RawRecord("req", 0, offset, b"k", value)
    return record, Rejection(RejectCode.MALFORMED_JSON, "not JSON", None)


async def test_plain_mode_sends_again_only_what_failed() -> None:
    failing = {"on": True}
    producer = ScriptedProducer(
        refuse=lambda topic, _v: KafkaTimeoutError() if topic == "dlq" and failing["on"] else None
    )
    commits: list[Any] = []
    clock = Clock()
    box = outbox(producer, transactional=False, commits=commits, clock=clock)
    await box.start()
    box.track(0, PartitionLedger(committed=0))
    for offset in range(3):
        box.read(0, offset)
    box.answer(result("a", 0), None)
    box.reject(*bad_record(1, b"{oops"), None)
    box.answer(result("c", 2), None)
    await box.flush()
    assert commits == [{0: (1, "kvgate/1 results_from=101")}], "up to the unwritten offset 1"
    assert [s.partition for s in box.stuck()] == [0] and sum(
        box.unwritten_by_partition().values()
    ) == 1
    failing["on"] = False
    producer.log.clear()
    clock.past_any_backoff()
    await box.flush()
    assert [v for k, v in producer.log if k == "send"] == [("dlq", None, b"k")], "only the retry"
    assert (
        commits[-1][0][0] == 3
        and not box.stuck()
        and sum(box.unwritten_by_partition().values()) == 0
    )


@pytest.mark.parametrize("transactional", [True, False])
async def test_a_refused_dead_letter_is_shrunk_and_the_partition_moves_on(
    transactional: bool,
) -> None:
    # The topic accepts less than the service measured at start-up (its config was changed).
    producer = ScriptedProducer(
        refuse=lambda t, v: (
            MessageSizeTooLargeError() if t == "dlq" and len(v or b"") > 16_384 else None
        )
    )
    commits: list[Any] = []
    clock = Clock()
    box = outbox(producer, transactional=transactional, commits=commits, clock=clock)
    await box.start()
    await box.open_partition(0)
    box.track(0, PartitionLedger(committed=0))
    box.read(0, 0)
    original = b"y" * 50_000
    box.reject(*bad_record(0, original), None)
    for _ in range(3):
        await box.flush()
        clock.past_any_backoff()
    sent = [v for k, v in producer.log if k == "send"]
    assert sent.count(("dlq", None, b"k")) == 1, "written once, in its smallest form"
    committed = [v for k, v in producer.log if k == "offsets"] if transactional else commits
    assert committed and sum(box.unwritten_by_partition().values()) == 0


def test_a_dead_letter_of_any_shape_fits_its_room() -> None:
    letter = DeadLetter(code=RejectCode.TOO_LARGE, reason="r" * 5000, topic="req", partition=0,
                        offset=9)  # fmt: skip
    shapes = [
        (b"k" * 10, b"v" * 10, []),
        (b"k" * 10, b"v" * 200_000, []),
        (b"k" * 200_000, b"v", []),
        (b"k", b"v", [("h", b"x" * 200_000)]),
        (b"k", None, [(f"h{i}", b"x" * 100) for i in range(2000)]),
    ]
    for key, value, headers in shapes:
        copy = dead_letter_copy(key, value, headers, letter, max_bytes=DLQ_ROOM)
        assert record_bytes(copy.key, copy.value, copy.headers) <= DLQ_ROOM
        described = DeadLetter.from_headers(copy.headers)
        whole = value or b""
        assert copy.truncated == described.truncated
        if copy.truncated:
            assert described.original_bytes == len(whole)
            assert described.sha256 == hashlib.sha256(whole).hexdigest()
            assert whole.startswith(copy.value) and (described.offset, described.topic) == (
                9,
                "req",
            )
        else:
            assert (copy.key, copy.value) == (key, whole)


async def test_answers_discarded_before_they_are_durable_are_not_remembered_as_answered() -> None:
    """Regression (the fencing scenario): answers of a fenced or revoked partition are dropped
    and their requests read again — they must then run, not be taken for duplicates."""
    producer = ScriptedProducer(refuse=lambda _topic, _value: KafkaTimeoutError())
    answered = AnsweredIds(window_s=600.0, max_ids=100)
    box = Outbox(
        KAFKA,
        transactional=False,
        producer_factory=lambda _txn_id: producer,
        commit_offsets=lambda _offsets: asyncio.sleep(0),
        metrics=ServiceMetrics(),
        answered=answered,
    )
    await box.start()
    box.track(0, PartitionLedger(committed=0))
    box.read(0, 0)
    answered.add("a")  # the engine records an answer as it makes it
    box.answer(result("a", 0), None)
    answered.add("b")
    box.answer(result("b", 1, partition=3), None)  # a partition not (or no longer) held here
    assert "b" not in answered
    assert await box.close_partition(0) == 1  # revoked with the answer unwritten
    assert "a" not in answered
