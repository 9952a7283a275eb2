"""The admission service against real Kafka, as real processes (``kvgate admission-service`` and
``kvgate sim-executor`` on 127.0.0.1): a mixed workload with every kind of bad input, aborts,
backpressure, executor loss with identical outputs, and graceful shutdown.

Outputs are compared with a reference run of the same requests on one unconstrained
simulated executor (the simulated model's tokens depend on the block size, which matches).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvgate.protocol.enums import FinishReason
from kvgate.protocol.records import RejectCode, ResultStatus
from tests.admission_service.helpers import reference_outputs, request_body
from tests.admission_service.kafka_helpers import (
    Topics,
    committed_offsets,
    partition_ends,
    produce,
    read_dead_letters,
    read_results,
    read_token_chunks,
)
from tests.harness.kafka import KafkaBroker
from tests.integration.admission_stack import (
    Service,
    SimExecutor,
    service_settings,
    start_service,
    start_sim_executor,
)

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240, func_only=True)]
# Small caches: the workload preempts (block size 4 also gives the reference its geometry).
SMALL = {"num_blocks": 40, "block_size": 4, "host_snapshot_blocks": 16}


def workload(count: int, prefix: str, max_tokens: int = 10) -> list[dict[str, Any]]:
    return [
        request_body(
            f"{prefix}{i:02d}",
            prompt_len=6 + (i * 5) % 17,
            max_tokens=max_tokens + (i * 3) % 7,
            priority=i % 3,
        )
        for i in range(count)
    ]


def outputs(results: list[Any]) -> dict[str, tuple[list[int], list[int]]]:
    return {r.request_id: (r.output_token_ids, r.exit_depths) for r in results}


def stop_all(services: list[Service], executors: list[SimExecutor]) -> None:
    for service in services:
        service.process.stop()
    for executor in executors:
        executor.process.stop()


async def until(condition: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(condition):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def test_mixed_workload_bad_input_and_aborts(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    bootstrap = kafka_broker.bootstrap
    topics = Topics.unique("mixed")
    executors = [start_sim_executor(tmp_path, f"exec-{n}", step_time_ms=3, **SMALL) for n in "ab"]
    services: list[Service] = []
    good = workload(24, "m")
    expected = await reference_outputs(good, block_size=4)
    bad: list[dict[str, Any] | bytes] = [
        b"\x00not json",
        {"request_id": "bad-schema", "prompt": [1, 2], "temperature": 0.3},
        {"request_id": "bad-version", "schema_version": 9, "prompt": [1]},
        {"request_id": "bad-text", "prompt": "no tokenizer here"},
        {"request_id": "bad-long", "prompt": [1] * 300},
        {"request_id": "bad-priority", "prompt": [1], "priority": 5000},
        {"request_id": "bad-capacity", "prompt": [1] * 150, "max_tokens": 20},
        {"request_id": "bad-vocab", "prompt": [1, 600]},
    ]
    try:
        settings = service_settings(
            bootstrap,
            topics,
            executors,
            limits={"max_prompt_tokens": 256},
            kafka={"token_topic": topics.tokens},
            # Without the growth reserve, whose job is to avoid preemptions: this workload is
            # small, and its outputs must be checked across preemption and restore.
            scheduler={"growth_reserve_steps": 0},
        )
        services.append(start_service(tmp_path, "service", settings))
        service = services[0]
        # An abort read before its request: the request is answered "aborted" on arrival.
        await produce(bootstrap, topics.aborts, [{"request_id": "aborted-early"}])
        await until(lambda: service.metric("kvgate_admission_aborts_total") >= 1, "abort read")
        await produce(bootstrap, topics.requests, [*good[:12], *bad, *good[12:]])
        await produce(
            bootstrap,
            topics.requests,
            [request_body("aborted-early"), request_body("aborted-running", max_tokens=140)],
        )
        # Abort the long one once it streams tokens (it needs 140 steps of >= 3 ms).
        await read_token_chunks(
            bootstrap, topics.tokens, until_count=1, request_id="aborted-running"
        )
        await produce(bootstrap, topics.aborts, [{"request_id": "aborted-running"}])
        results = await read_results(bootstrap, topics.results, 24 + 7 + 2, settle_s=1.0)
        counts = Counter(r.request_id for r in results)
        assert set(counts.values()) == {1}, "exactly one answer each (read_committed)"
        by_id = {r.request_id: r for r in results}
        assert outputs([by_id[b["request_id"]] for b in good]) == expected
        assert all(by_id[b["request_id"]].status is ResultStatus.COMPLETED for b in good)
        for rid in ("aborted-early", "aborted-running"):
            assert by_id[rid].status is ResultStatus.ABORTED
            assert by_id[rid].finish_reason is FinishReason.ABORT
        assert 0 < len(by_id["aborted-running"].output_token_ids) < 140
        codes = {
            rid: r.reject_code for rid, r in by_id.items() if r.status is ResultStatus.REJECTED
        }
        assert codes == {
            "bad-schema": RejectCode.SCHEMA,
            "bad-version": RejectCode.UNSUPPORTED_VERSION,
            "bad-text": RejectCode.TEXT_WITHOUT_TOKENIZER,
            "bad-long": RejectCode.PROMPT_TOO_LONG,
            "bad-priority": RejectCode.PRIORITY_OUT_OF_RANGE,
            "bad-capacity": RejectCode.INFEASIBLE,
            "bad-vocab": RejectCode.TOKEN_OUT_OF_VOCABULARY,
        }
        letters = await read_dead_letters(bootstrap, topics.dlq, 8)
        assert sorted(letter.code.value for _, letter in letters) == sorted(
            [RejectCode.MALFORMED_JSON.value, *(c.value for c in codes.values())]
        )
        for record, letter in letters:
            assert letter.topic == topics.requests and letter.reason
            if letter.code is RejectCode.MALFORMED_JSON:
                assert record.value == b"\x00not json"
        assert sum(r.scheduling.preemptions for r in results) > 0, "the caches were under pressure"
        assert service.metric("kvgate_admission_dead_letters_total") == 8
    finally:
        stop_all(services, executors)


async def test_backpressure_pauses_then_resumes(kafka_broker: KafkaBroker, tmp_path: Path) -> None:
    bootstrap = kafka_broker.bootstrap
    topics = Topics.unique("backpressure")
    executors = [start_sim_executor(tmp_path, "exec-slow", step_time_ms=30, **SMALL)]
    services: list[Service] = []
    try:
        settings = service_settings(
            bootstrap,
            topics,
            executors,
            kafka={"max_poll_records": 5},
            limits={"max_waiting_requests": 12, "resume_waiting_requests": 4},
        )
        services.append(start_service(tmp_path, "service", settings))
        service = services[0]
        await produce(bootstrap, topics.requests, workload(60, "bp", max_tokens=4))
        seen: dict[str, float] = {}

        def paused() -> bool:
            seen.update(service.scrape())
            return seen.get("kvgate_admission_paused") == 1

        await until(paused, "paused")
        assert seen["kvgate_admission_consumer_lag"] > 0, "records wait in Kafka while paused"
        await until(lambda: service.metric("kvgate_admission_paused") == 0, "resumed")
        results = await read_results(bootstrap, topics.results, 60, timeout_s=120)
        assert len({r.request_id for r in results}) == 60
    finally:
        stop_all(services, executors)


async def test_executor_loss_resumes_elsewhere_with_identical_outputs(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    bootstrap = kafka_broker.bootstrap
    topics = Topics.unique("loss")
    executors = [start_sim_executor(tmp_path, f"exec-{n}", step_time_ms=10, **SMALL) for n in "ab"]
    services: list[Service] = []
    bodies = workload(16, "l", max_tokens=36)
    expected = await reference_outputs(bodies, block_size=4)
    try:
        services.append(
            start_service(tmp_path, "service", service_settings(bootstrap, topics, executors))
        )
        await produce(bootstrap, topics.requests, bodies)
        await until(lambda: services[0].metric("kvgate_admission_steps_total") >= 30, "progress")
        executors[0].process.kill()  # the executor dies mid-run
        results = await read_results(bootstrap, topics.results, 16, settle_s=1.0, timeout_s=120)
        assert Counter(r.request_id for r in results) == Counter(b["request_id"] for b in bodies)
        assert outputs(results) == expected
        moved = [r for r in results if r.scheduling.executors == ["exec-a", "exec-b"]]
        assert moved, "requests running on the lost executor finished on the other one"
        assert services[0].metric("kvgate_admission_executor_losses_total") >= 1
    finally:
        stop_all(services, executors)


async def test_sigterm_finishes_work_commits_and_exits_zero(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    bootstrap = kafka_broker.bootstrap
    topics = Topics.unique("sigterm")
    executors = [start_sim_executor(tmp_path, "exec-a", step_time_ms=5, **SMALL)]
    services: list[Service] = []
    bodies = workload(20, "g", max_tokens=16)
    try:
        settings = service_settings(
            bootstrap, topics, executors, shutdown={"grace_period_s": 60}, kafka={"partitions": 2}
        )
        services.append(start_service(tmp_path, "service", settings))
        await produce(bootstrap, topics.requests, bodies)
        # Every record read first (a record still in Kafka at SIGTERM is left there, uncommitted,
        # for the next replica: the handoff test covers that; this one covers finishing them).
        await until(
            lambda: services[0].metric("kvgate_admission_requests_received_total") >= len(bodies),
            "all records read",
        )
        await read_results(bootstrap, topics.results, 3)
        services[0].process.signal(15)  # SIGTERM while most requests still run
        assert await asyncio.to_thread(services[0].process.wait, 90) == 0
        results = await read_results(bootstrap, topics.results, 20, settle_s=0.5)
        assert Counter(r.request_id for r in results) == Counter(b["request_id"] for b in bodies)
        ends = await partition_ends(bootstrap, topics.requests)
        assert await committed_offsets(bootstrap, topics.group, topics.requests, 2) == ends
    finally:
        stop_all(services, executors)


async def test_sigterm_hands_off_what_the_grace_period_does_not_cover(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    bootstrap = kafka_broker.bootstrap
    topics = Topics.unique("handoff")
    executors = [start_sim_executor(tmp_path, "exec-a", step_time_ms=20, **SMALL)]
    services: list[Service] = []
    bodies = workload(16, "h", max_tokens=40)
    try:
        settings = service_settings(
            bootstrap, topics, executors, shutdown={"grace_period_s": 0.5}, kafka={"partitions": 2}
        )
        services.append(start_service(tmp_path, "first", settings))
        await produce(bootstrap, topics.requests, bodies)
        await read_results(bootstrap, topics.results, 1)
        services[0].process.signal(15)
        assert await asyncio.to_thread(services[0].process.wait, 60) == 0
        assert "handing them off" in services[0].process.log_tail(100_000)
        services.append(start_service(tmp_path, "second", settings))
        results = await read_results(bootstrap, topics.results, 16, settle_s=1.0, timeout_s=120)
        assert Counter(r.request_id for r in results) == Counter(b["request_id"] for b in bodies)
    finally:
        stop_all(services, executors)
