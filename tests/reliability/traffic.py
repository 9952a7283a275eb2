"""Kafka traffic of the scenarios: records produced with their offsets, results and dead letters
read back (read_committed), and the check every scenario ends with.

Each produced record carries what must become of it (:class:`Expect`). :func:`check_outcomes`
matches the answers to the records by their source (partition, offset) — the identity of an
answer — so a duplicate, a lost request, an answer to nothing, a wrong status or a wrong output
is named with the record it concerns.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from aiokafka import AIOKafkaProducer

from kvgate.protocol.records import (
    DeadLetter,
    InferenceResult,
    RejectCode,
    ResultStatus,
)
from tests.admission_service.kafka_helpers import read_all
from tests.reliability.workloads import Output


class Expect(StrEnum):
    COMPLETE = "complete"  # one completed result with the reference outputs, no dead letter
    DEAD_LETTER = "dead_letter"  # one dead letter; a rejected result iff the id is readable
    # A copy of an id already in flight or answered: one dead letter (duplicate), no result —
    # the id's one answer is its first copy's.
    DUPLICATE = "duplicate"


@dataclass(frozen=True)
class Message:
    value: bytes | None
    key: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    expect: Expect = Expect.COMPLETE
    request_id: str | None = None  # the id the service can read (body, else key), if any
    codes: frozenset[RejectCode] = frozenset()  # allowed dead-letter codes (empty: any)
    label: str = "valid"  # what kind of input this is (reports)
    partition: int | None = None  # None: the producer's partitioner decides (by key)

    @classmethod
    def request(cls, body: dict[str, Any], **options: Any) -> Message:
        rid = body["request_id"]
        return cls(json.dumps(body).encode(), rid.encode(), request_id=rid, **options)


@dataclass(frozen=True)
class Sent:
    message: Message
    partition: int
    offset: int
    timestamp_ms: int = -1  # the record's create time (stamped by the producer)


async def send(
    bootstrap: str, topic: str, messages: Iterable[Message], *, max_request_size: int = 1 << 21
) -> list[Sent]:
    """Produce ``messages`` in order and return where each one landed.

    The producer is idempotent, as clients should be: a send retried across a broker outage
    (its first attempt written, the acknowledgement lost) would otherwise land twice, and the
    second copy is rightly answered as a duplicate of the first.
    """
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=True,
        max_request_size=max_request_size,
        linger_ms=5,
    )
    await producer.start()
    try:
        pending = [
            (
                m,
                await producer.send(
                    topic, m.value, key=m.key, headers=list(m.headers), partition=m.partition
                ),
            )
            for m in messages
        ]
        metadata = await asyncio.gather(*(future for _, future in pending))
    finally:
        await producer.stop()
    return [
        Sent(m, md.partition, md.offset, md.timestamp)
        for (m, _), md in zip(pending, metadata, strict=True)
    ]


def expected_results(sent: Sequence[Sent]) -> int:
    """How many results the records must produce (a duplicate: none of its own)."""
    return sum(
        1
        for s in sent
        if s.message.expect is Expect.COMPLETE
        or (s.message.expect is Expect.DEAD_LETTER and s.message.request_id)
    )


def expected_letters(sent: Sequence[Sent]) -> int:
    return sum(1 for s in sent if s.message.expect is not Expect.COMPLETE)


async def read_answers(
    bootstrap: str, topic: str, count: int, *, timeout_s: float = 120.0, settle_s: float = 1.0
) -> list[InferenceResult]:
    records = await read_all(
        bootstrap, topic, until_count=count, timeout_s=timeout_s, settle_s=settle_s
    )
    return [InferenceResult.model_validate_json(r.value) for r in records]


async def read_letters(
    bootstrap: str, topic: str, count: int, *, timeout_s: float = 120.0, settle_s: float = 1.0
) -> list[tuple[Any, DeadLetter]]:
    if count == 0:
        return []
    records = await read_all(
        bootstrap, topic, until_count=count, timeout_s=timeout_s, settle_s=settle_s
    )
    return [(r, DeadLetter.from_headers(list(r.headers))) for r in records]


@dataclass
class Summary:
    completed: int = 0
    dead_letters: Counter[str] = field(default_factory=Counter)  # by code
    truncated: int = 0  # dead letters that carry a prefix of an oversized original
    preemptions: int = 0
    max_bypasses: int = 0
    moved: int = 0  # completed on more than one executor


def check_outcomes(
    request_topic: str,
    sent: Sequence[Sent],
    results: Sequence[InferenceResult],
    letters: Sequence[tuple[Any, DeadLetter]],
    reference: Mapping[str, Output],
) -> Summary:
    """Every record has exactly the outcome it expects; raises AssertionError listing problems."""
    by_source: dict[tuple[int, int], list[InferenceResult]] = defaultdict(list)
    problems: list[str] = []
    for result in results:
        if result.source is None or result.source.topic != request_topic:
            problems.append(f"a result answers no request of {request_topic}: {result}")
            continue
        by_source[(result.source.partition, result.source.offset)].append(result)
    dead: dict[tuple[int, int], list[tuple[Any, DeadLetter]]] = defaultdict(list)
    for record, letter in letters:
        dead[(letter.partition, letter.offset)].append((record, letter))
    known = {(s.partition, s.offset) for s in sent}
    problems += [f"results for unknown record {k}" for k in by_source.keys() - known]
    problems += [f"dead letters for unknown record {k}" for k in dead.keys() - known]
    summary = Summary()
    for item in sent:
        where = (item.partition, item.offset)
        problems += _check_one(
            item, by_source.get(where, []), dead.get(where, []), reference, summary
        )
    if problems:
        shown = "\n  ".join(problems[:25])
        raise AssertionError(f"{len(problems)} problems, first ones:\n  {shown}")
    return summary


def _check_one(
    item: Sent,
    answers: list[InferenceResult],
    letters: list[tuple[Any, DeadLetter]],
    reference: Mapping[str, Output],
    summary: Summary,
) -> list[str]:
    m = item.message
    at = f"{m.label} record {m.request_id!r} at {item.partition}/{item.offset}"
    expect = m.expect
    if expect is Expect.COMPLETE:
        if letters:
            return [f"{at}: dead-lettered ({letters[0][1].code}: {letters[0][1].reason})"]
        if len(answers) != 1:
            return [f"{at}: {len(answers)} results, expected one"]
        (result,) = answers
        if result.status is not ResultStatus.COMPLETED:
            return [f"{at}: {result.status} ({result.reason}), expected completed"]
        got = (result.output_token_ids, result.exit_depths)
        if m.request_id not in reference or got != reference[m.request_id]:
            return [f"{at}: outputs {got} differ from the reference {reference.get(m.request_id)}"]
        summary.completed += 1
        summary.preemptions += result.scheduling.preemptions
        summary.max_bypasses = max(summary.max_bypasses, result.scheduling.bypasses)
        summary.moved += len(result.scheduling.executors) > 1
        return []
    if len(letters) != 1:
        return [f"{at}: {len(letters)} dead letters, expected one"]
    record, letter = letters[0]
    problems = []
    if m.codes and letter.code not in m.codes:
        problems.append(f"{at}: dead letter {letter.code}, expected one of {sorted(m.codes)}")
    if not letter.reason.strip():
        problems.append(f"{at}: dead letter without a reason")
    problems += _check_copy(at, record, letter, m)
    summary.dead_letters[letter.code.value] += 1
    summary.truncated += letter.truncated
    wanted = 1 if m.request_id is not None and expect is Expect.DEAD_LETTER else 0
    if len(answers) != wanted:
        return [*problems, f"{at}: {len(answers)} results, expected {wanted}"]
    for result in answers:
        if result.status is not ResultStatus.REJECTED or result.reject_code is not letter.code:
            problems.append(f"{at}: result {result.status}/{result.reject_code}, not rejected")
        if result.request_id != m.request_id:
            problems.append(f"{at}: rejected result names {result.request_id!r}")
    return problems


def _check_copy(at: str, record: Any, letter: DeadLetter, m: Message) -> list[str]:
    """The dead letter keeps the original; one too large for the dead-letter topic keeps a
    prefix, with the whole original's size and hash."""
    original = m.value or b""
    if not letter.truncated:
        if record.value != original or record.key != m.key:
            return [f"{at}: the dead letter does not keep the original key and bytes"]
        return []
    whole = (letter.original_bytes, letter.sha256)
    if whole != (len(original), hashlib.sha256(original).hexdigest()):
        return [f"{at}: a truncated dead letter describes {whole}, not the original"]
    if not original.startswith(record.value or b"\x00"):
        return [f"{at}: a truncated dead letter is not a prefix of the original"]
    return []
