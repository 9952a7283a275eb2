"""Delivery against real Kafka with real processes: a crash between writing results and
committing them produces no duplicate for a read_committed consumer, and a rebalance between
two service instances answers every request exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest

from kvgate.admission_service.faults import CRASH_EXIT_CODE, CRASH_POINT_ENV
from kvgate.protocol.records import ResultStatus
from tests.admission_service.helpers import request_body
from tests.admission_service.kafka_helpers import (
    Topics,
    committed_offsets,
    partition_ends,
    produce,
    read_all,
    read_results,
)
from tests.harness.kafka import KafkaBroker
from tests.integration.admission_stack import (
    Service,
    service_settings,
    start_service,
    start_sim_executor,
)

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240, func_only=True)]


async def until_logged(service: Service, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in service.process.log_tail(1_000_000):
        if not service.process.alive or time.monotonic() > deadline:
            raise AssertionError(f"{service.process.name} never logged {text!r}")
        await asyncio.sleep(0.1)


def answers_by_id(results: list[object]) -> Counter[str]:
    return Counter(r.request_id for r in results)  # type: ignore[attr-defined]


async def test_crash_between_results_and_commit_leaves_no_duplicate(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    bootstrap = kafka_broker.bootstrap
    topics = Topics.unique("crash")
    # Paced steps (10 ms) spread the answers over many 50 ms commit cycles, so the third cycle
    # that carries answers comes while most requests still run.
    executor = start_sim_executor(tmp_path, "exec-0", step_time_ms=10)
    settings = service_settings(bootstrap, topics, [executor], kafka={"partitions": 2})
    bodies = [request_body(f"c{i:02d}", max_tokens=8 + i % 9) for i in range(30)]
    crashing: Service | None = None
    successor: Service | None = None
    try:
        # The third commit cycle that carries answers dies after writing them, before commit.
        crashing = start_service(
            tmp_path, "crashing", settings, env={CRASH_POINT_ENV: "before_commit:3"}
        )
        await produce(bootstrap, topics.requests, bodies)
        code = await asyncio.to_thread(crashing.process.wait, 120)
        assert code == CRASH_EXIT_CODE, crashing.process.log_tail()
        assert "exactly-once on" in crashing.process.log_tail(100_000)
        successor = start_service(tmp_path, "successor", settings)
        results = await read_results(bootstrap, topics.results, 30, settle_s=2.0)
        counts = answers_by_id(results)
        assert counts == Counter({b["request_id"]: 1 for b in bodies}), "exactly one each"
        assert {r.status for r in results} == {ResultStatus.COMPLETED}
        # The crash really fell between write and commit: uncommitted readers see the
        # aborted transaction's answers as well.
        raw = await read_all(
            bootstrap, topics.results, until_count=30, read_committed=False, settle_s=1.0
        )
        assert len(raw) > 30, "the crashed transaction must have written answers"
        await asyncio.to_thread(successor.process.signal, 15)
        assert await asyncio.to_thread(successor.process.wait, 60) == 0
        ends = await partition_ends(bootstrap, topics.requests)
        committed = await committed_offsets(bootstrap, topics.group, topics.requests, len(ends))
        assert committed == ends
    finally:
        for service in (crashing, successor):
            if service is not None:
                service.process.stop()
        executor.process.stop()


async def test_rebalance_between_two_instances_answers_each_request_once(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    bootstrap = kafka_broker.bootstrap
    topics = Topics.unique("rebalance")
    executors = [
        start_sim_executor(tmp_path, "exec-a", step_time_ms=20),
        start_sim_executor(tmp_path, "exec-b", step_time_ms=5),
    ]
    first_settings = service_settings(bootstrap, topics, executors[:1], kafka={"partitions": 4})
    second_settings = service_settings(bootstrap, topics, executors[1:], kafka={"partitions": 4})
    bodies = [request_body(f"rb{i:02d}", max_tokens=16) for i in range(60)]
    services: list[Service] = []
    try:
        services.append(start_service(tmp_path, "first", first_settings))
        await produce(bootstrap, topics.requests, bodies[:30])
        await read_results(bootstrap, topics.results, 3)  # the first one is busy
        services.append(start_service(tmp_path, "second", second_settings))
        # Once the second owns partitions (the first handed its work in them over) ...
        await until_logged(services[1], "assigned at offset")
        await until_logged(services[0], "revoked")
        # ... new requests in them go to the second.
        await produce(bootstrap, topics.requests, bodies[30:])
        results = await read_results(bootstrap, topics.results, 60, settle_s=2.0, timeout_s=120)
        assert answers_by_id(results) == Counter({b["request_id"]: 1 for b in bodies})
        by_executor = Counter(r.scheduling.executors[-1] for r in results)
        assert set(by_executor) == {"exec-a", "exec-b"}, by_executor
    finally:
        for service in services:
            service.process.stop()
        for executor in executors:
            executor.process.stop()
