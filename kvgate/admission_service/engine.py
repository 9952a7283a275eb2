"""The engine: requests in, placement over executors, results out.

One :class:`ExecutorHandle` (scheduler + step loop) per executor. A new request goes to the
ready executor with the most free KV capacity — its cache blocks minus the full-length need of
every request already placed there — so a burst spreads by what it will cost, not by count.
Requests with nowhere to go (no executor ready yet) wait unplaced, in arrival order.

Every request gets a global ``arrival_seq`` when it is read, so a request that moves between
executors (executor lost, drained or removed) keeps its place in admission order; it resumes by
recompute from what it had generated (``Scheduler.evacuate`` / ``add_request(progress=...)``)
and produces the same outputs.

The engine never talks to Kafka: finished work goes to an :class:`OutcomeSink`, which owns
delivery (see ``outbox.py``).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from opentelemetry.trace import Span

from kvgate.admission_service.admin_api import ExecutorSpec, ExecutorStatus
from kvgate.admission_service.executor_client import Connector, EpochClock
from kvgate.admission_service.membership import Membership
from kvgate.admission_service.messages import (
    FinishReason,
    InferenceResult,
    RejectCode,
    ResultStatus,
    SourceRef,
    TokenChunk,
)
from kvgate.admission_service.metrics import ExecutorGauge, ServiceMetrics
from kvgate.admission_service.pool import ExecutorHandle, SessionSettings
from kvgate.admission_service.scheduler.config import SchedulerConfig
from kvgate.admission_service.scheduler.errors import RequestRejected
from kvgate.admission_service.scheduler.events import (
    FinishedEvent,
    RequestEvent,
    StepReport,
    TokenEvent,
)
from kvgate.admission_service.scheduler.request import FinishReason as SchedulerFinish
from kvgate.admission_service.scheduler.scheduler import RequestProgress
from kvgate.admission_service.stops import find_stop
from kvgate.admission_service.tokenizer import TextCodec
from kvgate.admission_service.tracing import ServiceTracer, traceparent_of_span
from kvgate.admission_service.tracking import (
    Tracked,
    finished_result,
    output_logprobs,
    rejected_result,
    unfinished_result,
)
from kvgate.admission_service.validation import Accepted, RawRecord, Rejection, build_spec
from kvgate.gpu_executor.api import StepPlan, StepResult

log = logging.getLogger(__name__)


class OutcomeSink(Protocol):
    """Where answers go. ``answer`` and ``reject`` make the source offset final."""

    def answer(self, result: InferenceResult, traceparent: str | None) -> None: ...

    def reject(
        self, record: RawRecord, rejection: Rejection, result: InferenceResult | None
    ) -> None: ...

    def token(self, source: SourceRef, chunk: TokenChunk) -> None: ...


@dataclass(frozen=True, slots=True)
class StepSample:
    """One applied step, for timelines (the demo's plot)."""

    at_s: float
    executor: str
    step_id: int
    waiting: int
    running: int
    kv_blocks_used: int
    preemptions: int


@dataclass(frozen=True, slots=True)
class EngineSettings:
    scheduler: SchedulerConfig
    session: SessionSettings
    max_request_failures: int = 3
    token_stream: bool = False
    abort_memory_s: float = 600.0
    timeline_steps: int = 0  # keep this many StepSamples (0: none)


class Engine:
    def __init__(
        self,
        settings: EngineSettings,
        *,
        connector: Connector,
        sink: OutcomeSink,
        tracer: ServiceTracer,
        metrics: ServiceMetrics,
        tokenizer: TextCodec | None = None,
        epochs: EpochClock | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._sink = sink
        self._tracer = tracer
        self.metrics = metrics
        self._tokenizer = tokenizer
        self._clock = clock
        self.members = Membership(
            connector=connector,
            epochs=epochs or EpochClock(),
            scheduler=settings.scheduler,
            session=settings.session,
            observer=self,
        )
        self._requests: dict[str, Tracked] = {}
        self._unplaced: list[tuple[int, str]] = []  # heap of (arrival_seq, request id)
        self._num_unplaced = 0
        self._next_seq = 0
        self._aborted: OrderedDict[str, float] = OrderedDict()  # id -> forget after (clock)
        self._step_spans: dict[tuple[str, int], Span] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.timeline: deque[StepSample] = deque(maxlen=settings.timeline_steps or None)
        self._started_at = clock()

    # ---------------------------------------------------------------------------- views
    @property
    def num_tracked(self) -> int:
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        """Requests read and not running: unplaced, or queued in an executor's scheduler."""
        return self._num_unplaced + self.members.num_waiting

    @property
    def num_running(self) -> int:
        return self.members.num_running

    @property
    def num_unplaced(self) -> int:
        return self._num_unplaced

    def executor_gauges(self) -> list[ExecutorGauge]:
        return self.members.gauges()

    async def wait_idle(self) -> None:
        """Returns once no request read by this service is unanswered."""
        await self._idle.wait()

    # ----------------------------------------------------------------------- membership
    @property
    def handles(self) -> dict[str, ExecutorHandle]:
        return self.members.handles

    async def set_members(self, specs: list[ExecutorSpec]) -> None:
        await self.members.set(specs)

    def drain(self, name: str) -> ExecutorStatus | None:
        return self.members.drain(name)

    async def close(self) -> None:
        """Leave every executor; requests not finished are handed off (left unanswered)."""
        await self.members.close()
        for tracked in list(self._requests.values()):
            tracked.handed_off = True
            self._release(tracked)
            self._tracer.handed_off(tracked.span, tracked.request, tracked.source)

    # ------------------------------------------------------------------------- requests
    def submit(self, record: RawRecord, accepted: Accepted) -> None:
        """Queue a validated request (or answer it at once: duplicate, aborted earlier)."""
        request = accepted.request
        # Fields already typed by the consumer: no validation needed on this hot path.
        source = SourceRef.model_construct(
            topic=record.topic, partition=record.partition, offset=record.offset
        )
        rid = request.request_id
        if rid in self._requests:
            reason = "a request with this id is already in flight"
            self._reject_record(
                record, Rejection(RejectCode.DUPLICATE, reason, rid), record.traceparent
            )
            return
        span = self._tracer.start_request(request, source, record.traceparent)
        spec = build_spec(accepted, traceparent_of_span(span))
        self._next_seq += 1
        tracked = Tracked(request, spec, source, self._next_seq, self._clock(), span, record)
        self._requests[rid] = tracked
        self._idle.clear()
        if self._forget_abort(rid):
            self._answer(
                tracked, ResultStatus.ABORTED, "aborted before it was read", FinishReason.ABORT
            )
            return
        self._place(tracked)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; returns whether it was in flight here (else it is remembered)."""
        self.metrics.aborts.inc()
        tracked = self._requests.get(request_id)
        if tracked is None:
            self._remember_abort(request_id)
            return False
        handle = self.handles.get(tracked.executor) if tracked.executor else None
        if (
            handle is not None
            and handle.scheduler is not None
            and handle.scheduler.abort(request_id)
        ):
            self.on_events(handle, handle.scheduler.pop_events())
            handle.wake()
        else:
            self._answer(tracked, ResultStatus.ABORTED, "aborted while waiting", FinishReason.ABORT)
        return True

    def drop_partition(self, topic: str, partition: int) -> int:
        """Hand off every request read from a revoked partition: it is cancelled here without
        an answer, so its offset stays uncommitted and the partition's next owner runs it."""
        dropped = [
            t
            for t in self._requests.values()
            if (t.source.topic, t.source.partition) == (topic, partition)
        ]
        for tracked in dropped:
            tracked.handed_off = True
            handle = self.handles.get(tracked.executor) if tracked.executor else None
            if (
                handle is not None
                and handle.scheduler is not None
                and handle.scheduler.abort(tracked.request_id)
            ):
                self.on_events(handle, handle.scheduler.pop_events())
                handle.wake()
            else:
                self._release(tracked)
                self._tracer.handed_off(tracked.span, tracked.request, tracked.source)
        return len(dropped)

    # ------------------------------------------------------------------------ placement
    def _place(self, tracked: Tracked) -> None:
        candidates = self.members.ready()
        if not candidates:
            tracked.executor = None
            tracked.unplaced = True
            heapq.heappush(self._unplaced, (tracked.arrival_seq, tracked.request_id))
            self._num_unplaced += 1
            return
        problems: list[tuple[RejectCode, str]] = []
        for handle in candidates:
            problem = self._try_place(tracked, handle)
            if problem is None:
                return
            problems.append(problem)
        code, reason = problems[0]
        if tracked.progress is None and tracked.record is not None:
            self._reject_tracked(tracked, code, reason)
        else:
            self._answer(
                tracked, ResultStatus.FAILED, f"cannot resume after its executor left: {reason}"
            )

    def _try_place(self, tracked: Tracked, handle: ExecutorHandle) -> tuple[RejectCode, str] | None:
        scheduler, info = handle.scheduler, handle.info
        assert scheduler is not None and info is not None
        prompt = tracked.spec.prompt_token_ids
        if max(prompt) >= info.vocab_size:
            return (
                RejectCode.TOKEN_OUT_OF_VOCABULARY,
                f"token id {max(prompt)} is outside the model's vocabulary ({info.vocab_size})",
            )
        try:
            scheduler.add_request(
                tracked.spec, arrival_seq=tracked.arrival_seq, progress=tracked.progress
            )
        except RequestRejected as exc:
            return RejectCode.INFEASIBLE, f"{handle.name}: {exc.reason}"
        tracked.executor = handle.name
        tracked.executors.append(handle.name)
        tracked.blocks = handle.blocks_for(len(prompt), tracked.request.max_tokens)
        handle.reserved_blocks += tracked.blocks
        tracked.record = None
        tracked.progress = None
        handle.wake()
        return None

    def _place_unplaced(self) -> None:
        while self._unplaced and self.members.ready():
            _, rid = heapq.heappop(self._unplaced)
            tracked = self._requests.get(rid)
            if tracked is None or not tracked.unplaced:
                continue  # answered meanwhile (lazy deletion)
            tracked.unplaced = False
            self._num_unplaced -= 1
            self._place(tracked)

    # ------------------------------------------------------------------ pool observer
    def on_ready(self, handle: ExecutorHandle) -> None:
        handle.reserved_blocks = 0
        self._place_unplaced()
        self.members.evacuate_drains()

    def on_events(self, handle: ExecutorHandle, events: list[RequestEvent]) -> None:
        requests = self._requests
        token_stream = self.settings.token_stream
        for event in events:
            tracked = requests.get(event.request_id)
            if tracked is None or tracked.executor != handle.name:
                continue  # an event of a request that has moved on
            if isinstance(event, TokenEvent):
                if tracked.first_token_at is None:
                    tracked.first_token_at = self._clock()
                if event.logprob is not None and event.output_index == len(tracked.logprobs):
                    tracked.logprobs.append(output_logprobs(event, self._tokenizer))
                if tracked.request.stop and self._tokenizer is not None:
                    self._stop_on_text(handle, tracked, event)
                if (
                    token_stream
                    and not tracked.handed_off
                    and event.output_index >= tracked.tokens_out
                ):
                    tracked.tokens_out = event.output_index + 1
                    chunk = TokenChunk(
                        request_id=event.request_id, index=event.output_index,
                        token_id=event.token_id, exit_depth=event.exit_depth,
                    )  # fmt: skip
                    self._sink.token(tracked.source, chunk)
            elif isinstance(event, FinishedEvent):
                if tracked.handed_off:
                    self._release(tracked)
                    self._tracer.handed_off(tracked.span, tracked.request, tracked.source)
                    continue
                result = finished_result(tracked, event, self._clock(), self._tokenizer)
                self._deliver(tracked, result)

    def _stop_on_text(self, handle: ExecutorHandle, tracked: Tracked, event: TokenEvent) -> None:
        """Finish the request (reason stop) once its text holds one of its stop strings."""
        assert self._tokenizer is not None
        if tracked.stop_text is not None or handle.scheduler is None:
            return
        if event.output_index != len(tracked.output_token_ids):
            return  # not a new token (every output arrives once, in order)
        tracked.output_token_ids.append(event.token_id)
        text = self._tokenizer.decode(tracked.output_token_ids)
        cut = find_stop(text, tracked.request.stop)
        if cut is not None:
            tracked.stop_text = text[:cut]
            if handle.scheduler.abort(tracked.request_id, SchedulerFinish.STOP):
                self.on_events(handle, handle.scheduler.pop_events())
                handle.wake()

    def on_lifted(
        self, handle: ExecutorHandle, lifted: list[RequestProgress], failure: str | None
    ) -> None:
        if failure is not None:
            self.metrics.executor_losses.labels(executor=handle.name).inc()
        limit = self.settings.max_request_failures
        for progress in lifted:
            tracked = self._requests.get(progress.spec.request_id)
            if tracked is None or tracked.executor != handle.name:
                continue
            handle.reserved_blocks -= tracked.blocks
            tracked.executor = None
            tracked.blocks = 0
            tracked.progress = progress
            if failure is not None:
                tracked.failures += 1
                if tracked.failures >= limit:
                    reason = (
                        f"{tracked.failures} executors failed while running it (last: {failure})"
                    )
                    self._answer(tracked, ResultStatus.FAILED, reason)
                    continue
            self._place(tracked)

    def before_send(self, handle: ExecutorHandle, plan: StepPlan, report: StepReport) -> StepPlan:
        now = self._clock()
        links: list[Span] = []
        for request_id, _kind in report.admitted:
            tracked = self._requests.get(request_id)
            if tracked is not None:
                links.append(tracked.span)
                if tracked.admitted_at is None:
                    tracked.admitted_at = now
        self.metrics.observe_step(report)
        span = self._tracer.start_step(handle.name, plan, report, links)
        traceparent = traceparent_of_span(span)
        self._step_spans[(handle.name, plan.step_id)] = span
        if self.timeline.maxlen:
            self.timeline.append(
                StepSample(
                    now - self._started_at, handle.name, plan.step_id, report.num_waiting,
                    report.num_running, report.blocks_used, len(report.preemptions),
                )
            )  # fmt: skip
        return plan if traceparent is None else plan.model_copy(update={"traceparent": traceparent})

    def after_apply(
        self, handle: ExecutorHandle, plan: StepPlan, result: StepResult, round_trip_s: float
    ) -> None:
        span = self._step_spans.pop((handle.name, plan.step_id), None)
        if span is not None:
            self._tracer.end_step(span, result, round_trip_s)
        self.metrics.steps.labels(executor=handle.name).inc()
        self.metrics.step_round_trip.observe(round_trip_s)

    # ------------------------------------------------------------------------- answers
    def _release(self, tracked: Tracked) -> None:
        """Forget a request (answered or handed off)."""
        self._requests.pop(tracked.request_id, None)
        if tracked.unplaced:
            tracked.unplaced = False  # its heap entry is skipped when popped
            self._num_unplaced -= 1
        elif tracked.executor is not None and tracked.executor in self.handles:
            self.handles[tracked.executor].reserved_blocks -= tracked.blocks
        if not self._requests:
            self._idle.set()

    def _deliver(self, tracked: Tracked, result: InferenceResult) -> None:
        self._release(tracked)
        self._sink.answer(result, tracked.traceparent)
        self.metrics.results.labels(status=result.status.value).inc()
        self._tracer.finish_request(tracked.span, tracked.request, result)

    def _answer(
        self,
        tracked: Tracked,
        status: ResultStatus,
        reason: str,
        finish: FinishReason | None = None,
    ) -> None:
        result = unfinished_result(tracked, status, reason, self._clock(), finish_reason=finish)
        self._deliver(tracked, result)

    def _reject_tracked(self, tracked: Tracked, code: RejectCode, reason: str) -> None:
        assert tracked.record is not None
        record = tracked.record
        result = unfinished_result(tracked, ResultStatus.REJECTED, reason, self._clock(), code=code)
        self._release(tracked)
        self.metrics.rejections.labels(code=code.value).inc()
        self.metrics.results.labels(status=result.status.value).inc()
        self._sink.reject(record, Rejection(code, reason, tracked.request_id), result)
        self._tracer.finish_request(tracked.span, tracked.request, result)

    def _reject_record(
        self, record: RawRecord, rejection: Rejection, traceparent: str | None
    ) -> None:
        source = SourceRef(topic=record.topic, partition=record.partition, offset=record.offset)
        result = None
        if rejection.request_id is not None:
            result = rejected_result(rejection.request_id, source, rejection.code, rejection.reason)
            self.metrics.results.labels(status=result.status.value).inc()
        self.metrics.rejections.labels(code=rejection.code.value).inc()
        self._sink.reject(record, rejection, result)
        self._tracer.rejected_record(
            rejection.request_id, source, traceparent, result, rejection.reason
        )

    def reject(self, record: RawRecord, rejection: Rejection) -> None:
        """A record that failed validation: dead letter, and a result when the id is known."""
        self._reject_record(record, rejection, record.traceparent)

    # --------------------------------------------------------------------------- aborts
    def _remember_abort(self, request_id: str) -> None:
        now = self._clock()
        self._aborted[request_id] = now + self.settings.abort_memory_s
        self._aborted.move_to_end(request_id)
        while self._aborted:
            oldest, expires = next(iter(self._aborted.items()))
            if expires > now and len(self._aborted) <= 100_000:
                break
            del self._aborted[oldest]

    def _forget_abort(self, request_id: str) -> bool:
        expires = self._aborted.pop(request_id, None)
        return expires is not None and expires > self._clock()
