"""One ``kvgate.step`` span per step, with the step's attributes, a child of the plan's trace
context and linked to the spans of the requests it served (SDK setup: tests/telemetry)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, StatusCode, TraceFlags

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel
from kvgate.protocol import step as wire
from kvgate.telemetry import attributes as attr
from kvgate.telemetry.context import span_context_from_traceparent, traceparent_of


def _context(trace_id: int, span_id: int) -> SpanContext:
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(1))


REQ_A = _context(0xA1, 0x1A)
REQ_B = _context(0xB2, 0x2B)
SCHEDULER = _context(0xC3, 0x3C)


@pytest.fixture
def traced(looped: LoadedModel) -> tuple[Executor, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    executor = Executor(
        looped,
        num_blocks=32,
        block_size=4,
        host_snapshot_blocks=6,
        tracer=provider.get_tracer("test"),
        model_name="/models/looped-test",
    )
    return executor, exporter


def _request(rid: str, context: SpanContext) -> wire.NewRequest:
    return wire.NewRequest(
        request_id=rid,
        prompt_token_ids=[1, 2, 3, 4, 5],
        traceparent=traceparent_of(context),
        sampling=wire.SamplingParams(max_tokens=3),
    )


def test_traceparent_round_trip() -> None:
    assert span_context_from_traceparent(traceparent_of(REQ_A)) == REQ_A
    assert span_context_from_traceparent("not-a-traceparent") is None
    assert span_context_from_traceparent(None) is None


def test_one_span_per_step_with_attributes_and_links(
    traced: tuple[Executor, InMemorySpanExporter],
) -> None:
    executor, exporter = traced
    fill = wire.StepPlan(
        step_id=1,
        traceparent=traceparent_of(SCHEDULER),
        new_requests=[_request("a", REQ_A), _request("b", REQ_B)],
        block_appends=[
            wire.BlockAppend(request_id="a", new_block_ids=[[0, 1], [2, 3], [4, 5]]),
            wire.BlockAppend(request_id="b", new_block_ids=[[6, 7], [8, 9], [10, 11]]),
        ],
        prefill_rows=[
            wire.PrefillRow(
                request_id="a",
                token_start=0,
                token_end=5,
                depth_first=1,
                depth_last=3,
                completes_fill=True,
            ),
            wire.PrefillRow(
                request_id="b", token_start=0, token_end=3, depth_first=1, depth_last=1
            ),
        ],
    )
    decode = wire.StepPlan(
        step_id=2,
        swap_out=["b"],
        decode=wire.DecodeRows(request_ids=["a"], positions=[5], depths=[1]),
    )
    for plan in (fill, decode):
        assert executor.execute(plan).error is None

    spans: tuple[ReadableSpan, ...] = exporter.get_finished_spans()
    assert [s.name for s in spans] == [attr.STEP_SPAN, attr.STEP_SPAN]
    first, second = spans
    assert first.parent is not None and first.parent.span_id == SCHEDULER.span_id
    assert first.context.trace_id == SCHEDULER.trace_id
    assert {link.context.span_id for link in first.links} == {REQ_A.span_id, REQ_B.span_id}
    assert {link.context.span_id for link in second.links} == {REQ_A.span_id}  # only a ran
    a1 = first.attributes or {}
    assert a1[attr.STEP_ID] == 1
    assert a1[attr.GEN_AI_REQUEST_MODEL] == "/models/looped-test"
    assert a1[attr.STEP_ROWS] == 2 and a1[attr.STEP_PREFILL_ROWS] == 2
    assert a1[attr.STEP_PREFILL_TOKENS] == 8
    assert a1[attr.STEP_NEW_REQUESTS] == 2 and a1[attr.STEP_RECOMPUTES] == 0
    assert tuple(a1[attr.STEP_DEPTH_TOKEN_PASSES]) == (8, 5, 5)  # type: ignore[arg-type]
    assert a1[attr.STEP_MAX_DEPTH] == 3
    assert a1[attr.STEP_SAMPLED_TOKENS] == 1
    assert a1[attr.KV_BLOCKS_USED] == 12 and a1[attr.KV_BLOCKS_FREE] == 20
    assert a1[attr.KV_BLOCKS_TOTAL] == 32
    assert float(a1[attr.STEP_KERNEL_S]) > 0.0  # type: ignore[arg-type]
    assert float(a1[attr.STEP_EXECUTE_S]) >= float(a1[attr.STEP_KERNEL_S])  # type: ignore[arg-type]
    a2 = second.attributes or {}
    assert a2[attr.STEP_SWAP_OUTS] == 1 and a2[attr.STEP_DECODE_ROWS] == 1
    assert a2[attr.STEP_DECODE_TOKENS] == 1
    assert a2[attr.KV_BLOCKS_USED] == 6 and a2[attr.KV_HOST_BLOCKS_USED] == 6
    assert a2[attr.KV_SNAPSHOTS] == 1 and a2[attr.KV_REQUESTS] == 2
    assert second.status.status_code is StatusCode.UNSET


def test_rejected_plan_span_carries_the_error(
    traced: tuple[Executor, InMemorySpanExporter],
) -> None:
    executor, exporter = traced
    result = executor.execute(wire.StepPlan(step_id=7, free=["nobody"]))
    assert result.error is not None
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert (span.attributes or {})[attr.STEP_ERROR_CODE] == "unknown_request"
    assert (span.attributes or {})[attr.GEN_AI_REQUEST_MODEL] == "/models/looped-test"
