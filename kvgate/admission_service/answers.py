"""Where every answer of the service is built and sent: results, dead letters, token chunks.

The engine decides *that* a request is answered (and forgets it first); this module decides
*what* goes out — the result record, its metrics and the end of its span — so each kind of
answer is written once, and every id answered is recorded (``AnsweredIds``: one answer per id).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from kvgate.admission_service.idempotency import AnsweredIds
from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.admission_service.outputs import shaped
from kvgate.admission_service.token_stream import StreamLane
from kvgate.admission_service.tokenizer import TextCodec
from kvgate.admission_service.tracing import ServiceTracer
from kvgate.admission_service.tracking import (
    Tracked,
    finished_result,
    rejected_result,
    unfinished_result,
)
from kvgate.admission_service.validation import RawRecord, Rejection
from kvgate.protocol.enums import FinishReason
from kvgate.protocol.records import (
    InferenceResult,
    RejectCode,
    ReplyTo,
    ResultStatus,
    SourceRef,
    TokenChunk,
    TokenLogprob,
    chunk_head,
    plain_chunk_json,
    stream_json,
)
from kvgate.scheduler.events import FinishedEvent, TokenEvent


class OutcomeSink(Protocol):
    """Where answers go. ``answer`` and ``reject`` make the source offset final."""

    def answer(
        self, result: InferenceResult, traceparent: str | None, reply: ReplyTo | None = None
    ) -> None: ...

    def reject(
        self, record: RawRecord, rejection: Rejection, result: InferenceResult | None
    ) -> None: ...

    def lane(self, source: SourceRef, reply: ReplyTo | None) -> StreamLane | None:
        """Where the chunks of a request read from ``source`` go (None: nowhere); it stays
        valid while ``open``."""

    def put(self, lane: StreamLane, chunk: str) -> None:
        """Stream ``chunk`` (``records.stream_json``'s text) to ``lane``'s targets."""


class Answers:
    def __init__(
        self,
        sink: OutcomeSink,
        *,
        tracer: ServiceTracer,
        metrics: ServiceMetrics,
        clock: Callable[[], float],
        answered: AnsweredIds,
        tokenizer: TextCodec | None = None,
    ) -> None:
        self._sink = sink
        self._answered = answered
        self._tracer = tracer
        self._metrics = metrics
        self._clock = clock
        self._tokenizer = tokenizer

    def finished(self, tracked: Tracked, event: FinishedEvent) -> None:
        self.deliver(tracked, self.finished_result(tracked, event))

    def finished_result(self, tracked: Tracked, event: FinishedEvent) -> InferenceResult:
        """The result of a finished output (one choice's, for ``n > 1``), tool calls and prompt
        log-probabilities included (``outputs.shaped``)."""
        result = finished_result(tracked, event, self._clock(), self._tokenizer)
        return shaped(result, tracked, self._tokenizer)

    def unfinished(
        self,
        tracked: Tracked,
        status: ResultStatus,
        reason: str,
        finish: FinishReason | None = None,
    ) -> None:
        result = unfinished_result(tracked, status, reason, self._clock(), finish_reason=finish)
        self._deliver(tracked, result)

    def rejected(self, tracked: Tracked, code: RejectCode, reason: str) -> None:
        """A request that cannot run anywhere: a rejected result and a dead letter of its record."""
        assert tracked.record is not None
        result = unfinished_result(tracked, ResultStatus.REJECTED, reason, self._clock(), code=code)
        self._answered.add(result.request_id)
        self._metrics.rejections.labels(code=code.value).inc()
        self._metrics.results.labels(status=result.status.value).inc()
        self._metrics.observe_result(tracked.request.priority, result)
        rejection = Rejection(code, reason, tracked.request_id, tracked.request.reply)
        self._sink.reject(tracked.record, rejection, result)
        self._tracer.finish_request(tracked.span, tracked.request, result)

    def rejected_record(self, record: RawRecord, rejection: Rejection, *, in_flight: bool) -> None:
        """A record that never became a request: a dead letter, and a result when the id is
        known and neither answered already nor answered by a copy in flight (``in_flight``)."""
        source = SourceRef(topic=record.topic, partition=record.partition, offset=record.offset)
        result = None
        rid = rejection.request_id
        if rid is not None and not in_flight and rid not in self._answered:
            result = rejected_result(rid, source, rejection.code, rejection.reason)
            self._answered.add(rid)
            self._metrics.results.labels(status=result.status.value).inc()
        self._metrics.rejections.labels(code=rejection.code.value).inc()
        self._sink.reject(record, rejection, result)
        self._tracer.rejected_record(
            rejection.request_id, source, record.traceparent, result, rejection.reason
        )

    def tokens(self, made: Iterable[tuple[Tracked, TokenEvent]]) -> None:
        """Stream each of ``made``'s tokens as a chunk of its request (a step's, in order)."""
        sink = self._sink
        for tracked, (_, index, token_id, exit_depth, logprob, top) in made:
            lane = tracked.lane
            if lane is None or not lane.open:
                lane = tracked.lane = sink.lane(tracked.source, tracked.request.reply)
                if lane is None:
                    continue
                tracked.chunk_head = chunk_head(tracked.request.request_id)
            if logprob is None and top is None:  # one per streamed token: no model made
                chunk = plain_chunk_json(
                    tracked.chunk_head, index, token_id, exit_depth, tracked.choice
                )
            else:
                chunk = stream_json(
                    TokenChunk(
                        request_id=tracked.request.request_id, index=index, token_id=token_id,
                        exit_depth=exit_depth, choice=tracked.choice, logprob=logprob,
                        top_logprobs=(
                            [TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in top]
                            if top is not None else None
                        ),
                    )
                )  # fmt: skip
            sink.put(lane, chunk)

    def handed_off(self, tracked: Tracked) -> None:
        """No answer: another instance owns the request now (its span says so)."""
        self._tracer.handed_off(tracked.span, tracked.request, tracked.source)

    def deliver(self, tracked: Tracked, result: InferenceResult) -> None:
        """Send ``result`` as the answer of ``tracked``'s request (its span ends here)."""
        self._deliver(tracked, result)

    def _deliver(self, tracked: Tracked, result: InferenceResult) -> None:
        self._answered.add(result.request_id)
        self._sink.answer(result, tracked.traceparent, tracked.request.reply)
        self._metrics.results.labels(status=result.status.value).inc()
        self._metrics.observe_result(tracked.request.priority, result)
        self._tracer.finish_request(tracked.span, tracked.request, result)
