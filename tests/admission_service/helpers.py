"""Shared pieces of the admission-service unit tests: records, a recording sink, an engine on
in-process simulated executors, and the reference run every scheduling test compares with."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvgate.admission_service.engine import Engine, EngineSettings
from kvgate.admission_service.executor_handle import SessionSettings
from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.admission_service.placement import PlacementSettings
from kvgate.admission_service.settings import LimitsSettings
from kvgate.admission_service.token_stream import StreamLane, StreamTarget
from kvgate.admission_service.tokenizer import TextCodec
from kvgate.admission_service.tracing import ServiceTracer
from kvgate.admission_service.validation import (
    Accepted,
    RawRecord,
    Rejection,
    validate_request,
)
from kvgate.protocol.admin import ExecutorSpec, ExecutorState
from kvgate.protocol.records import InferenceResult, ReplyTo, ResultStatus, SourceRef, TokenChunk
from kvgate.protocol.tenants import TenantsSettings
from kvgate.scheduler.config import PreemptionMode, SchedulerConfig
from kvgate.sim.backend import LocalConnector, SimExecutorConfig

TOPIC = "kvgate.requests"


def request_body(
    request_id: str,
    *,
    prompt: list[int] | str | None = None,
    prompt_len: int = 12,
    max_tokens: int = 8,
    priority: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    if prompt is None:
        seed = sum(ord(c) for c in request_id)
        prompt = [(seed * 31 + 7 * i) % 500 + 1 for i in range(prompt_len)]
    return {
        "request_id": request_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "priority": priority,
        "sampling": {"ignore_eos": True, "seed": 1},
        **extra,
    }


def record(
    body: dict[str, Any] | bytes | None,
    offset: int,
    *,
    partition: int = 0,
    key: bytes | None = None,
    headers: tuple[tuple[str, bytes], ...] = (),
) -> RawRecord:
    value = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    if key is None and isinstance(body, dict) and isinstance(body.get("request_id"), str):
        key = body["request_id"].encode()
    return RawRecord(TOPIC, partition, offset, key, value, headers, 1_700_000_000_000)


@dataclass
class RecordingSink:
    """Collects what the engine hands to delivery."""

    answers: dict[str, InferenceResult] = field(default_factory=dict)
    answer_log: list[InferenceResult] = field(default_factory=list)
    rejects: list[tuple[RawRecord, Rejection, InferenceResult | None]] = field(default_factory=list)
    streamed: list[TokenChunk] = field(default_factory=list)  # the chunks put, parsed
    traceparents: dict[str, str | None] = field(default_factory=dict)

    def answer(
        self, result: InferenceResult, traceparent: str | None, reply: ReplyTo | None = None
    ) -> None:
        self.answers[result.request_id] = result
        self.answer_log.append(result)
        self.traceparents[result.request_id] = traceparent

    def reject(
        self, record: RawRecord, rejection: Rejection, result: InferenceResult | None
    ) -> None:
        self.rejects.append((record, rejection, result))
        if result is not None:
            self.answers[result.request_id] = result
            self.answer_log.append(result)

    def lane(self, source: SourceRef, reply: ReplyTo | None = None) -> StreamLane | None:
        return StreamLane(source.partition, (StreamTarget("tokens", source.partition),))

    def put(self, lane: StreamLane, chunk: str) -> None:
        self.streamed.append(TokenChunk.model_validate_json(chunk))


def scheduler_config(**changes: Any) -> SchedulerConfig:
    base = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "prefill_chunk_size": 32,
        "async_scheduling": True,
    }
    return SchedulerConfig(**(base | changes))


@dataclass
class EngineRig:
    engine: Engine
    connector: LocalConnector
    sink: RecordingSink
    spans: InMemorySpanExporter
    limits: LimitsSettings
    offset: int = 0
    tokenizer: TextCodec | None = None

    def submit(self, body: dict[str, Any], *, partition: int = 0) -> RawRecord:
        rec = record(body, self.offset, partition=partition)
        self.offset += 1
        verdict = validate_request(rec, self.limits, self.tokenizer)
        if isinstance(verdict, Accepted):
            self.engine.submit(rec, verdict)
        else:
            self.engine.reject(rec, verdict)
        return rec

    async def add_executors(self, *names: str, **config: Any) -> None:
        for name in names:
            self.connector.add(name, SimExecutorConfig(executor_id=name, **config))
        specs = [ExecutorSpec(name=n, endpoint=f"ws://local/{n}") for n in self.connector.backends]
        await self.engine.set_members(specs)
        await until(
            lambda: all(h.state is ExecutorState.READY for h in self.engine.handles.values()),
            what="executors ready",
        )


def make_rig(
    *,
    scheduler: SchedulerConfig | None = None,
    token_stream: bool = False,
    tokenizer: TextCodec | None = None,
    migrate_on_drain: bool = False,
    connector: Any = None,
    placement: PlacementSettings | None = None,
    tenants: TenantsSettings | None = None,
    **limits: Any,
) -> EngineRig:
    """An engine over in-process simulated executors (or over ``connector``)."""
    connector = connector if connector is not None else LocalConnector()
    sink = RecordingSink()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = EngineSettings(
        scheduler=scheduler or scheduler_config(),
        session=SessionSettings(
            reconnect_initial_s=0.01,
            reconnect_max_s=0.05,
            enable_prefix_caching=True,
            migrate_on_drain=migrate_on_drain,
        ),
        token_stream=token_stream,
        timeline_steps=10_000,
        placement=placement or PlacementSettings(),
        tenants=tenants or TenantsSettings(),
    )
    engine = Engine(
        settings,
        connector=connector,
        sink=sink,
        tracer=ServiceTracer(provider.get_tracer("test")),
        metrics=ServiceMetrics(),
        tokenizer=tokenizer,
    )
    return EngineRig(
        engine, connector, sink, exporter, LimitsSettings(**limits), tokenizer=tokenizer
    )


async def until(
    condition: Callable[[], bool], *, timeout_s: float = 20.0, what: str = "condition"
) -> None:
    """Poll ``condition`` on the event loop until it holds (never a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def settle(rig: EngineRig, count: int, timeout_s: float = 30.0) -> None:
    await until(
        lambda: len(rig.sink.answers) >= count, timeout_s=timeout_s, what=f"{count} answers"
    )


async def reference_outputs(
    bodies: list[dict[str, Any]], **executor: Any
) -> dict[str, tuple[list[int], list[int]]]:
    """Outputs (token ids, exit depths) with room for everything and preemption off."""
    rig = make_rig(scheduler=scheduler_config(preemption=PreemptionMode.OFF, max_num_seqs=256))
    await rig.add_executors("ref", **(executor | {"num_blocks": 4096}))
    for body in bodies:
        rig.submit(body)
    await settle(rig, len(bodies))
    await rig.engine.close()
    out = {}
    for rid, result in rig.sink.answers.items():
        assert result.status is ResultStatus.COMPLETED, result
        out[rid] = (result.output_token_ids, result.exit_depths)
    return out


async def closing(rig: EngineRig, body: Callable[[], Awaitable[None]]) -> None:
    try:
        await body()
    finally:
        await rig.engine.close()
