"""Intake's rebalance callbacks around the take-over (takeover.py), without Kafka.

- the assignment callback returns at once (aiokafka heartbeats only once it has), leaving
  every assigned partition paused; each is resumed alone once taken over;
- intake resuming after backpressure resumes only partitions already taken over (and not
  fenced): a partition without its ledger is never fetched;
- a revocation waits for take-overs still running before it closes partitions;
- a failed take-over fails the service.

The take-over of each partition is replaced by one that waits for the test to release it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka import TopicPartition

from kvgate.admission_service.intake import Intake
from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.admission_service.settings import load_settings
from kvgate.admission_service.takeover import TakeOvers
from tests.admission_service.helpers import until

TOPIC = "kvgate.requests"
TPS = [TopicPartition(TOPIC, p) for p in range(3)]


@dataclass
class FakeConsumer:
    assigned: set[TopicPartition] = field(default_factory=set)
    paused: set[TopicPartition] = field(default_factory=set)

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def pause(self, *tps: TopicPartition) -> None:
        self.paused |= set(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.paused -= set(tps)

    def fetching(self) -> set[TopicPartition]:
        return self.assigned - self.paused


@dataclass
class FakeEngine:
    answered: Any = None
    num_waiting: int = 0
    dropped: list[int] = field(default_factory=list)

    def drop_partition(self, topic: str, partition: int) -> int:
        self.dropped.append(partition)
        return 0


@dataclass
class FakeOutbox:
    transactional: bool = True
    ledgers: dict[int, object] = field(default_factory=dict)
    closed: list[int] = field(default_factory=list)

    async def close_partition(self, partition: int) -> int:
        self.closed.append(partition)
        return 0


@dataclass
class Rig:
    intake: Intake
    consumer: FakeConsumer
    outbox: FakeOutbox
    gates: dict[TopicPartition, asyncio.Event]
    failures: list[BaseException]
    broken: set[TopicPartition] = field(default_factory=set)

    async def assign(self, tps: list[TopicPartition]) -> None:
        self.consumer.assigned = set(tps)
        await asyncio.wait_for(self.intake.assigned(set(tps)), 1.0)

    def release(self, *tps: TopicPartition) -> None:
        for tp in tps:
            self.gates[tp].set()


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    gates = {tp: asyncio.Event() for tp in TPS}
    failures: list[BaseException] = []
    settings = load_settings(
        None,
        {
            "kafka": {"bootstrap_servers": "127.0.0.1:9", "request_topic": TOPIC},
            "executors": {"members": [{"name": "a", "endpoint": "ws://local/a"}]},
        },
    )
    consumer, outbox = FakeConsumer(), FakeOutbox()
    intake = Intake(
        settings,
        consumer,  # type: ignore[arg-type]
        engine=FakeEngine(),  # type: ignore[arg-type]
        outbox=outbox,  # type: ignore[arg-type]
        metrics=ServiceMetrics(),
        tokenizer=None,
        on_failure=failures.append,
    )
    made = Rig(intake, consumer, outbox, gates, failures)

    async def gated_take_over(self: TakeOvers, tp: TopicPartition) -> None:
        await gates[tp].wait()
        if tp in made.broken:
            raise RuntimeError(f"{tp} cannot be taken over")
        outbox.ledgers[tp.partition] = object()

    monkeypatch.setattr(TakeOvers, "_take_over", gated_take_over)
    yield made


async def test_the_callback_returns_at_once_and_each_partition_is_read_once_taken_over(
    rig: Rig,
) -> None:
    await rig.assign(TPS)  # returns although nothing is taken over yet
    assert rig.consumer.fetching() == set()
    assert not rig.intake.assigned_once.is_set()
    rig.release(TPS[1])
    await until(lambda: rig.consumer.fetching() == {TPS[1]}, what="partition 1 read")
    rig.release(TPS[0], TPS[2])
    await until(rig.intake.assigned_once.is_set, what="the assignment taken over")
    assert rig.consumer.fetching() == set(TPS)
    assert not rig.failures


async def test_resuming_after_backpressure_skips_partitions_not_taken_over(rig: Rig) -> None:
    await rig.assign(TPS)
    rig.release(TPS[0])
    await until(lambda: TPS[0] in rig.consumer.fetching(), what="partition 0 read")
    rig.intake.paused = True  # backpressure paused everything meanwhile
    rig.consumer.pause(*TPS)
    rig.intake._backpressure()  # nothing waits any more: resume
    assert not rig.intake.paused
    assert rig.consumer.fetching() == {TPS[0]}, "1 and 2 have no ledger yet"
    rig.release(TPS[1])
    await until(lambda: rig.consumer.fetching() == {TPS[0], TPS[1]}, what="partition 1 read")


async def test_a_fenced_partition_is_not_resumed_by_backpressure(rig: Rig) -> None:
    await rig.assign(TPS)
    rig.release(*TPS)
    await until(rig.intake.assigned_once.is_set, what="the assignment taken over")
    rig.intake.fenced(TPS[2].partition)
    rig.intake.paused = True
    rig.consumer.pause(*TPS)
    rig.intake._backpressure()
    assert rig.consumer.fetching() == {TPS[0], TPS[1]}


async def test_a_revocation_waits_for_take_overs_still_running(rig: Rig) -> None:
    await rig.assign(TPS)
    rig.release(TPS[0])
    revoking = asyncio.create_task(rig.intake.revoked(set(TPS)))
    await until(lambda: TPS[0] in rig.consumer.fetching(), what="partition 0 read")
    assert not revoking.done() and rig.outbox.closed == [], "1 and 2 are still being taken over"
    rig.release(TPS[1], TPS[2])
    await asyncio.wait_for(revoking, 5.0)
    assert rig.outbox.closed == [0, 1, 2]


async def test_a_failed_take_over_fails_the_service(rig: Rig) -> None:
    rig.broken.add(TPS[1])
    await rig.assign(TPS)
    rig.release(*TPS)
    await until(lambda: bool(rig.failures), what="the failure reported")
    assert not rig.intake.assigned_once.is_set()
    assert TPS[1] not in rig.consumer.fetching()
