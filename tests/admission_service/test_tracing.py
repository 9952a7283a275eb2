"""Request spans (GenAI conventions) continue the producer's trace; step spans link to the
requests they admit and are the parent of the executor's step (through the plan)."""

from __future__ import annotations

import pytest

from kvgate.protocol.records import TRACEPARENT_HEADER
from kvgate.telemetry import attributes as attr

from .helpers import make_rig, record, request_body, settle

pytestmark = pytest.mark.timeout(60)
PRODUCER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PRODUCER_SPAN = "00f067aa0ba902b7"


async def test_request_span_continues_the_producer_trace_with_gen_ai_attributes() -> None:
    rig = make_rig()
    try:
        await rig.add_executors("a", num_blocks=64, block_size=4)
        body = request_body("traced", prompt=[1, 2, 3, 4], max_tokens=5, priority=2)
        body["sampling"] = {"temperature": 0.5, "top_k": 7, "seed": 3, "ignore_eos": True}
        header = f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01".encode()
        rec = record(body, 17, partition=1, headers=((TRACEPARENT_HEADER, header),))
        from kvgate.admission_service.validation import Accepted, validate_request

        verdict = validate_request(rec, rig.limits, None)
        assert isinstance(verdict, Accepted)
        rig.engine.submit(rec, verdict)
        await settle(rig, 1)
        spans = rig.spans.get_finished_spans()
        request_span = next(s for s in spans if s.name == "text_completion kvgate")
        context = request_span.context
        assert context is not None and request_span.parent is not None
        assert f"{context.trace_id:032x}" == PRODUCER_TRACE
        assert f"{request_span.parent.span_id:016x}" == PRODUCER_SPAN
        attributes = dict(request_span.attributes or {})
        assert attributes[attr.GEN_AI_OPERATION_NAME] == "text_completion"
        assert attributes[attr.GEN_AI_RESPONSE_ID] == "traced"
        assert attributes[attr.GEN_AI_REQUEST_MAX_TOKENS] == 5
        assert attributes[attr.GEN_AI_REQUEST_TEMPERATURE] == 0.5
        assert attributes[attr.GEN_AI_REQUEST_TOP_K] == 7
        assert attributes[attr.GEN_AI_USAGE_INPUT_TOKENS] == 4
        assert attributes[attr.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
        assert attributes[attr.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
        assert attributes[attr.MESSAGING_PARTITION] == "1"
        assert attributes[attr.MESSAGING_KAFKA_OFFSET] == 17
        assert attributes[attr.REQUEST_PRIORITY] == 2
        assert attributes[attr.REQUEST_STATUS] == "completed"
        # The result carries the request span's context for whoever reads it.
        traceparent = rig.sink.traceparents["traced"]
        assert traceparent == f"00-{PRODUCER_TRACE}-{context.span_id:016x}-01"
        # The step that admitted it links to it; the plan sent carried the step span's context.
        steps = [s for s in spans if s.name == attr.ADMISSION_STEP_SPAN]
        admitting = [s for s in steps if s.attributes and s.attributes[attr.STEP_ADMISSIONS]]
        assert admitting and any(
            link.context.span_id == context.span_id for link in admitting[0].links
        )
        step_ids = {f"{s.context.span_id:016x}" for s in steps if s.context is not None}
        sent = rig.connector.backends["a"].plan_traceparents
        assert sent and all(tp is not None and tp.split("-")[2] in step_ids for tp in sent)
    finally:
        await rig.engine.close()


async def test_rejected_input_is_traced_with_its_reason() -> None:
    rig = make_rig()
    try:
        rig.submit({"request_id": "bad", "prompt": [1], "priority": 10**6})
        spans = rig.spans.get_finished_spans()
        assert len(spans) == 1
        span = spans[0]
        assert span.status.status_code.name == "ERROR"
        assert (span.attributes or {})[attr.ERROR_TYPE] == "priority_out_of_range"
    finally:
        await rig.engine.close()
