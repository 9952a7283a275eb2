"""A request from the moment it is read until its result is out, and the results built from it.

Pure: times are passed in (monotonic seconds), nothing here talks to Kafka or an executor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.trace import Span

from kvgate.admission_service.choices import ChoiceGroup
from kvgate.admission_service.tokenizer import TextCodec, TokenizerError
from kvgate.admission_service.validation import RawRecord
from kvgate.protocol.enums import FinishReason
from kvgate.protocol.records import (
    InferenceRequest,
    InferenceResult,
    OutputLogprobs,
    RejectCode,
    ResultStatus,
    SchedulingFacts,
    SourceRef,
    Timings,
    TokenLogprob,
    Usage,
)
from kvgate.protocol.step import TokenLogprob as SampledLogprob
from kvgate.scheduler.events import FinishedEvent, TokenEvent
from kvgate.scheduler.request import RequestProgress, RequestSpec

if TYPE_CHECKING:
    from kvgate.admission_service.token_stream import StreamLane

_STATUS = {
    FinishReason.STOP: ResultStatus.COMPLETED,
    FinishReason.LENGTH: ResultStatus.COMPLETED,
    FinishReason.ABORT: ResultStatus.ABORTED,
    FinishReason.DEADLINE: ResultStatus.ABORTED,
}


@dataclass(eq=False, slots=True)
class Tracked:
    """Everything the service keeps about one request it read and has not answered yet."""

    request: InferenceRequest
    spec: RequestSpec
    source: SourceRef
    arrival_seq: int
    received_at: float
    span: Span
    record: RawRecord | None  # kept until first placed: an infeasible request is dead-lettered
    executor: str | None = None  # where it is queued or running now
    unplaced: bool = False  # waiting for an executor to be ready
    executors: list[str] = field(default_factory=list)
    progress: RequestProgress | None = None  # set while waiting to resume elsewhere
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens_out: int = 0
    # Streamed: where its chunks go (the outbox's lane for its partition and reply address)
    # and their common start (records.chunk_head).
    lane: StreamLane | None = None
    chunk_head: str = ""
    failures: int = 0  # executors that failed while it was on them
    moves: int = 0  # times placement moved it to another executor before it started
    handed_off: bool = False  # its partition was revoked: another instance answers it
    output_token_ids: list[int] = field(default_factory=list)  # kept when it has stop strings
    stop_text: str | None = None  # the text before the stop string that ended it
    logprobs: list[OutputLogprobs] = field(default_factory=list)  # when asked for, by index
    # n > 1: which choice this is (its scheduler id is ``choices.choice_id``) and the request's
    # choices, shared by every choice's Tracked.
    choice: int = 0
    group: ChoiceGroup | None = None
    # Prompt scoring: position -> (log-probability, alternatives), as fill rows report them.
    prompt_scores: dict[int, tuple[float, list[SampledLogprob]]] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        """The scheduler's id: the request's, or ``<id>#<c>`` for choice ``c > 0``."""
        return self.spec.request_id

    @property
    def traceparent(self) -> str | None:
        return self.spec.traceparent


def _timings(tracked: Tracked, now: float) -> Timings:
    def since(moment: float | None) -> float | None:
        return None if moment is None else max(0.0, moment - tracked.received_at)

    return Timings(
        queued_s=since(tracked.admitted_at),
        time_to_first_token_s=since(tracked.first_token_at),
        end_to_end_s=max(0.0, now - tracked.received_at),
    )


def finished_result(
    tracked: Tracked, event: FinishedEvent, now: float, tokenizer: TextCodec | None
) -> InferenceResult:
    stats = event.stats
    outputs = list(event.output_token_ids)
    return InferenceResult(
        request_id=tracked.request_id,
        status=_STATUS[event.reason],
        finish_reason=(
            # A stop string completed by the last token allowed: still a stop.
            FinishReason.STOP
            if tracked.stop_text is not None and event.reason is FinishReason.LENGTH
            else FinishReason(event.reason.value)
        ),
        output_token_ids=outputs,
        text=(tracked.stop_text if tracked.stop_text is not None else text_of(tokenizer, outputs)),
        logprobs=(
            tracked.logprobs[: len(outputs)] if tracked.request.logprobs is not None else None
        ),
        exit_depths=list(event.exit_depths),
        usage=Usage(
            prompt_tokens=len(tracked.spec.prompt_token_ids), completion_tokens=len(outputs)
        ),
        timings=_timings(tracked, now),
        scheduling=SchedulingFacts(
            preemptions=stats.preemptions,
            restores=stats.restores,
            restore_modes=list(stats.restore_modes),
            bypasses=stats.bypasses,
            recomputed_tokens=stats.recomputed_tokens,
            executors=list(tracked.executors),
        ),
        source=tracked.source,
    )


def unfinished_result(
    tracked: Tracked,
    status: ResultStatus,
    reason: str,
    now: float,
    *,
    code: RejectCode | None = None,
    finish_reason: FinishReason | None = None,
) -> InferenceResult:
    """A request answered without finishing: rejected at placement, failed, or aborted while
    waiting to be placed."""
    progress = tracked.progress
    outputs = list(progress.output_token_ids) if progress is not None else []
    return InferenceResult(
        request_id=tracked.request_id,
        status=status,
        reason=reason,
        reject_code=code,
        finish_reason=finish_reason,
        output_token_ids=outputs,
        exit_depths=list(progress.exit_depths) if progress is not None else [],
        usage=Usage(
            prompt_tokens=len(tracked.spec.prompt_token_ids), completion_tokens=len(outputs)
        ),
        timings=_timings(tracked, now),
        scheduling=SchedulingFacts(executors=list(tracked.executors)),
        source=tracked.source,
    )


def rejected_result(
    request_id: str, source: SourceRef, code: RejectCode, reason: str
) -> InferenceResult:
    """The answer to a record rejected before it was queued."""
    return InferenceResult(
        request_id=request_id,
        status=ResultStatus.REJECTED,
        reason=reason,
        reject_code=code,
        usage=Usage(prompt_tokens=0, completion_tokens=0),
        timings=Timings(end_to_end_s=0.0),
        source=source,
    )


def text_of(tokenizer: TextCodec | None, token_ids: list[int]) -> str | None:
    """The tokens' text; None without a tokenizer (or a pool whose model has none)."""
    if tokenizer is None:
        return None
    try:
        return tokenizer.decode(token_ids)
    except TokenizerError:
        return None


def output_logprobs(event: TokenEvent, tokenizer: TextCodec | None) -> OutputLogprobs:
    """The result's logprobs entry for one token event that carries them."""

    def text(token_id: int) -> str | None:
        return text_of(tokenizer, [token_id])

    assert event.logprob is not None
    return OutputLogprobs(
        token_id=event.token_id,
        logprob=event.logprob,
        token=text(event.token_id),
        top=[
            TokenLogprob(token_id=t.token_id, logprob=t.logprob, token=text(t.token_id))
            for t in event.top_logprobs or []
        ],
    )
