"""Request spans (GenAI semantic conventions) and admission-side step spans.

A request span starts when the request is read, as a child of the producer's span when the
record carries a ``traceparent`` header, and ends when its result is handed to Kafka. Its own
``traceparent`` travels to the executor inside the plan (``NewRequest.traceparent``), so the
executor's ``kvgate.step`` spans link to every request they serve. The admission service's
round-trip span of each step is the executor step span's parent (``StepPlan.traceparent``).
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from kvgate.protocol.records import InferenceRequest, InferenceResult, SourceRef
from kvgate.protocol.step import StepPlan, StepResult
from kvgate.scheduler.events import StepReport
from kvgate.telemetry import attributes as attr
from kvgate.telemetry.context import context_from_traceparent


@dataclass(frozen=True, slots=True)
class StepDecisions:
    """What the scheduler decided in one step, by request id (in plan order)."""

    admitted: tuple[str, ...]
    prefilled: tuple[str, ...]
    decoded: tuple[str, ...]
    preempted: tuple[str, ...]

    @classmethod
    def of(cls, plan: StepPlan, report: StepReport) -> StepDecisions:
        return cls(
            admitted=tuple(rid for rid, _ in report.admitted),
            prefilled=tuple(row.request_id for row in plan.prefill_rows),
            decoded=tuple(plan.decode.request_ids),
            preempted=tuple(p.victim_id for p in report.preemptions),
        )

    def attributes(self) -> dict[str, AttributeValue]:
        return {
            attr.STEP_ADMITTED_IDS: list(self.admitted),
            attr.STEP_PREFILL_IDS: list(self.prefilled),
            attr.STEP_DECODE_IDS: list(self.decoded),
            attr.STEP_PREEMPTED_IDS: list(self.preempted),
        }


class ServiceTracer:
    def __init__(self, tracer: Tracer | None = None, model_name: str = "kvgate") -> None:
        self._tracer = tracer or trace.get_tracer("kvgate.admission_service")
        self._model = model_name
        self._span_name = f"{attr.GEN_AI_OPERATION_TEXT_COMPLETION} {model_name}"

    # ------------------------------------------------------------------------- requests
    def start_request(
        self, request: InferenceRequest, source: SourceRef, traceparent: str | None
    ) -> Span:
        """The request's span, started when it is read. Only what identifies it is set here;
        its parameters are added when it ends (``finish_request``), off the intake path."""
        return self._tracer.start_span(
            self._span_name,
            context=context_from_traceparent(traceparent),
            kind=SpanKind.CONSUMER,
            attributes={
                attr.GEN_AI_OPERATION_NAME: attr.GEN_AI_OPERATION_TEXT_COMPLETION,
                attr.GEN_AI_PROVIDER_NAME: attr.GEN_AI_PROVIDER,
                attr.GEN_AI_REQUEST_MODEL: self._model,
                attr.GEN_AI_RESPONSE_ID: request.request_id,
            },
        )

    def finish_request(
        self, span: Span, request: InferenceRequest, result: InferenceResult
    ) -> None:
        if span.is_recording():
            span.set_attributes(
                request_attributes(request) | result_attributes(result, self._model)
            )
            if result.status.value in ("rejected", "failed"):
                span.set_status(Status(StatusCode.ERROR, result.reason))
        span.end()

    @staticmethod
    def migration(
        span: Span,
        *,
        outcome: str,
        source: str,
        target: str | None,
        detail: str,
        payload_bytes: int,
        seconds: float,
    ) -> None:
        """One migration attempt on the request's span: moved with its KV, or the fallback."""
        if span.is_recording():
            span.add_event(
                attr.MIGRATION_EVENT,
                {
                    attr.MIGRATION_OUTCOME: outcome,
                    attr.MIGRATION_SOURCE: source,
                    attr.MIGRATION_TARGET: target or "",
                    attr.MIGRATION_DETAIL: detail,
                    attr.MIGRATION_BYTES: payload_bytes,
                    attr.MIGRATION_SECONDS: seconds,
                },
            )

    def handed_off(self, span: Span, request: InferenceRequest, source: SourceRef) -> None:
        if span.is_recording():
            span.set_attributes(
                request_attributes(request)
                | _source_attributes(source)
                | {attr.REQUEST_STATUS: "handed_off"}
            )
        span.end()

    def rejected_record(
        self,
        request_id: str | None,
        source: SourceRef,
        traceparent: str | None,
        result: InferenceResult | None,
        reason: str,
    ) -> None:
        """A span for a record rejected before it was queued (bad input is traced too)."""
        attributes: dict[str, AttributeValue] = {
            attr.GEN_AI_OPERATION_NAME: attr.GEN_AI_OPERATION_TEXT_COMPLETION,
            attr.GEN_AI_PROVIDER_NAME: attr.GEN_AI_PROVIDER,
            attr.REQUEST_STATUS: "rejected",
            **_source_attributes(source),
        }
        if request_id is not None:
            attributes[attr.GEN_AI_RESPONSE_ID] = request_id
        span = self._tracer.start_span(
            self._span_name,
            context=context_from_traceparent(traceparent),
            kind=SpanKind.CONSUMER,
            attributes=attributes,
        )
        if result is not None and span.is_recording():
            span.set_attributes(result_attributes(result, self._model))
        span.set_status(Status(StatusCode.ERROR, reason))
        span.end()

    # ---------------------------------------------------------------------------- steps
    def start_step(
        self, executor: str, plan: StepPlan, report: StepReport, links: list[Span]
    ) -> Span:
        preemption_modes = [p.mode.value for p in report.preemptions]
        span = self._tracer.start_span(
            attr.ADMISSION_STEP_SPAN,
            kind=SpanKind.CLIENT,
            links=[Link(s.get_span_context()) for s in links if s.get_span_context().is_valid],
            attributes={
                attr.STEP_ID: plan.step_id,
                attr.EXECUTOR_ID: executor,
                attr.GEN_AI_REQUEST_MODEL: self._model,
                attr.STEP_ROWS: report.rows,
                attr.STEP_DECODE_ROWS: report.decode_rows,
                attr.STEP_PREFILL_ROWS: len(plan.prefill_rows),
                attr.STEP_PREFILL_TOKENS: report.prefill_tokens,
                attr.STEP_NEW_REQUESTS: len(plan.new_requests),
                attr.STEP_ADMISSIONS: len(report.admitted),
                attr.STEP_PREEMPTIONS: len(report.preemptions),
                attr.STEP_RESTORE_MODES: preemption_modes,
                attr.STEP_BYPASSES: len(report.bypassed),
                attr.STEP_BYPASS_LIMIT: report.bypass_limit,
                attr.STEP_MAX_BYPASSES: report.max_bypasses,
                attr.STEP_WAITING: report.num_waiting,
                attr.STEP_RUNNING: report.num_running,
                attr.KV_BLOCKS_USED: report.blocks_used,
                attr.KV_BLOCKS_FREE: report.blocks_free,
            },
        )
        if span.is_recording():  # a list of ids per step: only when someone records it
            span.set_attributes(StepDecisions.of(plan, report).attributes())
        return span

    @staticmethod
    def end_step(span: Span, result: StepResult, round_trip_s: float) -> None:
        if span.is_recording():
            span.set_attributes(
                {
                    attr.STEP_SAMPLED_TOKENS: result.num_tokens,
                    attr.STEP_EXECUTE_S: result.timings.execute_s,
                    attr.STEP_ROUND_TRIP_S: round_trip_s,
                }
            )
            if result.error is not None:
                span.set_attribute(attr.STEP_ERROR_CODE, result.error.code.value)
                span.set_status(Status(StatusCode.ERROR, result.error.message))
        span.end()


def traceparent_of_span(span: Span) -> str | None:
    """The W3C ``traceparent`` naming ``span`` (formatted directly: this runs per request)."""
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def _source_attributes(source: SourceRef) -> dict[str, AttributeValue]:
    return {
        attr.MESSAGING_SYSTEM: "kafka",
        attr.MESSAGING_DESTINATION: source.topic,
        attr.MESSAGING_PARTITION: str(source.partition),
        attr.MESSAGING_KAFKA_OFFSET: source.offset,
    }


def request_attributes(request: InferenceRequest) -> dict[str, AttributeValue]:
    sampling = request.sampling
    attributes: dict[str, AttributeValue] = {
        attr.GEN_AI_REQUEST_MAX_TOKENS: request.max_tokens,
        attr.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
        attr.GEN_AI_REQUEST_TOP_P: sampling.top_p,
        attr.REQUEST_PRIORITY: request.priority,
    }
    if sampling.seed is not None:
        attributes[attr.GEN_AI_REQUEST_SEED] = sampling.seed
    if sampling.top_k is not None:
        attributes[attr.GEN_AI_REQUEST_TOP_K] = sampling.top_k
    return attributes


def result_attributes(result: InferenceResult, model: str) -> dict[str, AttributeValue]:
    scheduling = result.scheduling
    attributes: dict[str, AttributeValue] = {
        **_source_attributes(result.source),
        attr.REQUEST_STATUS: result.status.value,
        attr.GEN_AI_RESPONSE_MODEL: model,
        attr.GEN_AI_USAGE_INPUT_TOKENS: result.usage.prompt_tokens,
        attr.GEN_AI_USAGE_OUTPUT_TOKENS: result.usage.completion_tokens,
        attr.REQUEST_PREEMPTIONS: scheduling.preemptions,
        attr.REQUEST_RESTORES: scheduling.restores,
        attr.REQUEST_RESTORE_MODES: [m.value for m in scheduling.restore_modes],
        attr.REQUEST_BYPASSES: scheduling.bypasses,
        attr.REQUEST_RECOMPUTED_TOKENS: scheduling.recomputed_tokens,
        attr.REQUEST_EXECUTORS: list(scheduling.executors),
    }
    if result.finish_reason is not None:
        attributes[attr.GEN_AI_RESPONSE_FINISH_REASONS] = [result.finish_reason.value]
    if result.reject_code is not None:
        attributes[attr.REQUEST_REJECT_CODE] = result.reject_code.value
        attributes[attr.ERROR_TYPE] = result.reject_code.value
    if result.timings.time_to_first_token_s is not None:
        attributes[attr.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = result.timings.time_to_first_token_s
    if result.timings.queued_s is not None:
        attributes[attr.REQUEST_QUEUED_S] = result.timings.queued_s
    return attributes
