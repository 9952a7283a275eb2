"""Admission service: how fast requests get from Kafka into the queues, and what a step's
WebSocket round trip adds.

    python benchmarks/bench_ingest.py [--requests N] [--steps N] [--bootstrap HOST:PORT]

1. Ingest. ``--requests`` valid requests (prompts of 16–256 tokens) are produced to a fresh
   request topic first; then an admission service (the real one: consumer group, validation,
   request spans, placement into per-executor schedulers) starts against them with two
   in-process simulated executors that hold their results, so nothing but intake runs. Timed:
   first record read → last request queued. Baselines measured in the same run on the same
   records: a bare aiokafka consumer reading them (the ceiling Kafka and the client allow), and
   validation alone in a loop. Broker: the embedded one (Tansu), or ``--bootstrap``.

2. Step round trip. A steady decode workload (8 requests) is planned step by step, once
   executed in-process by the simulated executor and once sent to ``kvgate sim-executor`` (a
   child process) over the WebSocket step protocol on loopback, one plan in flight. The plans
   are identical; the overhead of step i is its round trip minus its in-process execution.

Goals on the development machines: ≥ 5,000 requests/s ingested; overhead ≤ 2 ms median.
The machines are shared: next to wall-clock rates the ingest lines print requests per CPU-second
of the benchmark process, which other load does not inflate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from kvgate.admission_service.executor_client import WebSocketConnector
from kvgate.admission_service.executor_handle import scheduler_for
from kvgate.admission_service.kafka_io import ensure_topics
from kvgate.admission_service.service import AdmissionService, tune_garbage_collector
from kvgate.admission_service.settings import (
    ExactlyOnce,
    KafkaSettings,
    LimitsSettings,
    load_settings,
)
from kvgate.admission_service.validation import RawRecord, validate_request
from kvgate.local.embedded_broker import EmbeddedBroker
from kvgate.protocol.step import SamplingParams
from kvgate.scheduler.config import SchedulerConfig
from kvgate.scheduler.request import RequestSpec
from kvgate.sim.backend import LocalConnector, SimExecutorConfig

REPO = Path(__file__).resolve().parents[1]


def _bodies(count: int) -> list[bytes]:
    rng = random.Random(0)
    return [
        json.dumps(
            {
                "request_id": f"bench-{i}",
                "prompt": [rng.randint(1, 500) for _ in range(rng.randint(16, 256))],
                "max_tokens": rng.randint(16, 256),
                "priority": i % 3,
                "sampling": {"seed": i},
            }
        ).encode()
        for i in range(count)
    ]


async def _produce(bootstrap: str, topic: str, bodies: list[bytes]) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=False, linger_ms=5
    )
    await producer.start()
    try:
        futures = [
            await producer.send(topic, body, key=f"bench-{i}".encode())
            for i, body in enumerate(bodies)
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def _bare_consumer(bootstrap: str, topic: str, count: int) -> float:
    """Records/s of a bare consumer group reading the same topic (no work per record)."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"bare-{uuid.uuid4().hex[:6]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
        max_poll_records=500,
    )
    await consumer.start()
    seen = 0
    first = 0.0
    try:
        while seen < count:
            batch = await consumer.getmany(timeout_ms=200)
            for messages in batch.values():
                if messages and not seen:
                    first = time.perf_counter()
                seen += len(messages)
    finally:
        await consumer.stop()
    return count / (time.perf_counter() - first)


def _validation_only(bodies: list[bytes]) -> float:
    limits = LimitsSettings(max_waiting_requests=len(bodies) + 1)
    began = time.perf_counter()
    for offset, body in enumerate(bodies):
        validate_request(RawRecord("t", 0, offset, None, body), limits, None)
    return len(bodies) / (time.perf_counter() - began)


def _kafka_settings(bootstrap: str, topic_base: str, tansu: bool) -> KafkaSettings:
    return KafkaSettings(
        bootstrap_servers=bootstrap,
        request_topic=f"{topic_base}.requests",
        result_topic=f"{topic_base}.results",
        abort_topic=f"{topic_base}.aborts",
        dlq_topic=f"{topic_base}.dlq",
        partitions=6,
        exactly_once=ExactlyOnce.OFF if tansu else ExactlyOnce.AUTO,
        session_timeout_ms=2000 if tansu else 6000,
        heartbeat_interval_ms=500 if tansu else 1000,
    )


class _Dropping(SpanExporter):
    """Export that costs nothing: what remains is the SDK's own work per span."""

    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _sdk_tracer() -> trace.Tracer:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Dropping(), max_queue_size=200_000))
    return provider.get_tracer("bench")


async def _service_ingest(
    bootstrap: str, topic_base: str, count: int, tansu: bool, tracer: trace.Tracer | None
) -> tuple[float, float]:
    """(requests/s of wall-clock time, requests per CPU-second of this process)."""
    connector = LocalConnector()
    for name in ("sim-a", "sim-b"):
        backend = connector.add(name, SimExecutorConfig(num_blocks=100_000, block_size=16))
        backend.hold()  # no results: only intake runs
    kafka = _kafka_settings(bootstrap, topic_base, tansu)
    settings = load_settings(
        None,
        {
            "kafka": kafka.model_dump(mode="json", exclude_unset=True)
            | {"group_id": f"{topic_base}-group-{uuid.uuid4().hex[:6]}"},
            "admin": {"host": "127.0.0.1", "port": 0},
            "executors": {
                "members": [{"name": n, "endpoint": f"ws://local/{n}"} for n in connector.backends]
            },
            "limits": {"max_waiting_requests": count + 1},
            "shutdown": {"grace_period_s": 0},
        },
    )
    service = AdmissionService(settings, connector=connector, tracer=tracer)
    await service.start()
    tune_garbage_collector()  # as `kvgate admission-service` does after start-up
    engine = service.engine
    intake = service.intake
    assert engine is not None and intake is not None
    # Exact stamps: the first batch taken from Kafka, and the moment the last request is queued.
    first_read: list[float] = []
    queued = asyncio.Event()
    take, submit = intake._take, engine.submit

    def timed_take(partition: int, messages: list[Any]) -> None:
        if not first_read:
            first_read.extend((time.perf_counter(), time.process_time()))
        take(partition, messages)

    def timed_submit(record: RawRecord, accepted: Any) -> None:
        submit(record, accepted)
        if engine.num_tracked >= count:
            queued.set()

    intake._take = timed_take  # type: ignore[method-assign]
    engine.submit = timed_submit  # type: ignore[method-assign]
    try:
        await asyncio.wait_for(queued.wait(), 600)
        wall_s = time.perf_counter() - first_read[0]
        cpu_s = time.process_time() - first_read[1]
        return count / wall_s, count / cpu_s
    finally:
        await service.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _round_trips(steps: int) -> tuple[list[float], list[float]]:
    """(in-process execute times, WebSocket round trips), step by step, same plans."""
    config = SimExecutorConfig(num_blocks=4096, block_size=16)
    scheduler_config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)

    def workload(scheduler: object) -> None:
        for i in range(8):
            scheduler.add_request(  # type: ignore[attr-defined]
                RequestSpec(
                    f"rt-{i}",
                    tuple(range(1, 65)),
                    SamplingParams(max_tokens=steps + 8, ignore_eos=True, seed=i),
                )
            )

    backend = config.build()
    local = scheduler_for(backend.info, scheduler_config, True)
    workload(local)
    exec_times = []
    for _ in range(steps):
        plan = local.schedule(0.0)
        assert plan is not None
        began = time.perf_counter()
        result = backend.execute(plan)
        exec_times.append(time.perf_counter() - began)
        local.apply(result)

    token = secrets.token_hex(8)
    port = _free_port()
    env = dict(os.environ, KVGATE_EXECUTOR_TOKEN=token, PYTHONPATH=str(REPO))
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate", "sim-executor", "--port", str(port),
        "--num-blocks", "4096", "--block-size", "16",
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            connector = WebSocketConnector(
                http, token, connect_timeout_s=5, heartbeat_s=30, step_timeout_s=30
            )
            deadline = time.monotonic() + 30
            while True:
                try:
                    session = await connector(f"ws://127.0.0.1:{port}/v1/steps", epoch=1)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)
            remote = scheduler_for(session.info, scheduler_config, True)
            workload(remote)
            trips = []
            for _ in range(steps):
                plan = remote.schedule(0.0)
                assert plan is not None
                began = time.perf_counter()
                await session.send(plan)
                result = await session.receive()
                trips.append(time.perf_counter() - began)
                remote.apply(result)
            await session.close()
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), 10)
    return exec_times, trips


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--bootstrap", help="a real Kafka (default: the embedded broker)")
    args = parser.parse_args()
    bodies = _bodies(args.requests)
    base = f"bench{uuid.uuid4().hex[:8]}"
    broker = None if args.bootstrap else EmbeddedBroker().start()
    bootstrap = args.bootstrap or (broker.bootstrap if broker else "")
    try:
        await ensure_topics(_kafka_settings(bootstrap, base, tansu=broker is not None))
        await _produce(bootstrap, f"{base}.requests", bodies)
        validation = _validation_only(bodies)
        bare = await _bare_consumer(bootstrap, f"{base}.requests", len(bodies))
        tansu = broker is not None
        untraced = await _service_ingest(bootstrap, base, len(bodies), tansu, trace.NoOpTracer())
        traced = await _service_ingest(bootstrap, base, len(bodies), tansu, _sdk_tracer())
    finally:
        if broker is not None:
            broker.stop()
    where = "embedded Tansu" if broker is not None else f"Kafka at {bootstrap}"
    print(f"ingest: {len(bodies)} requests, prompts 16-256 tokens, {where}")
    print(f"  validation alone          {validation:10,.0f} requests/s")
    print(f"  bare consumer (baseline)  {bare:10,.0f} records/s")
    for label, (rate, cpu_rate) in (("no tracing", untraced), ("every request traced", traced)):
        print(f"  admission service, {label:<21}{rate:8,.0f} requests/s = {rate / bare:.3f} x "
              f"the bare consumer; {cpu_rate:,.0f} per CPU-second (goal >= 5,000/s)")  # fmt: skip

    exec_times, trips = await _round_trips(args.steps)
    overheads = [t - e for t, e in zip(trips, exec_times, strict=True)]
    ms = 1000.0
    print(f"step round trip: {args.steps} decode steps of 8 rows, loopback WebSocket")
    print(f"  in-process execute        median {statistics.median(exec_times) * ms:6.3f} ms")
    print(f"  WebSocket round trip      median {statistics.median(trips) * ms:6.3f} ms   "
          f"p99 {_quantile(trips, 0.99) * ms:6.3f} ms")  # fmt: skip
    print(f"  overhead per step         median {statistics.median(overheads) * ms:6.3f} ms   "
          f"p99 {_quantile(overheads, 0.99) * ms:6.3f} ms   (goal: median <= 2 ms)")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
