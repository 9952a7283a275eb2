"""Kafka message bodies: requests in, results and token chunks out, aborts, dead letters.

Every body is JSON validated by a pydantic model with ``extra="forbid"`` and a
``schema_version``; a producer that sends a field this version does not know is told so in the
dead-letter reason instead of having it silently ignored.

```
kvgate.requests       key = request_id   value = InferenceRequest   header traceparent (W3C)
kvgate.results        key = request_id   value = InferenceResult    same partition as the request
kvgate.tokens         key = request_id   value = TokenChunk         same partition as the request
kvgate.aborts         key = request_id   value = AbortRequest
kvgate.requests.dlq   key = original     value = original bytes     headers += kvgate-dlq-*
```
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvgate.admission_service.scheduler.config import RestoreMode

SCHEMA_VERSION: Final = 1
REQUEST_ID_PATTERN: Final = r"^[A-Za-z0-9._:/@+=-]{1,256}$"

RequestId = Annotated[str, Field(pattern=REQUEST_ID_PATTERN)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(ge=0.0)]


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ------------------------------------------------------------------------------ requests


class RequestSampling(_Message):
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: PositiveInt | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] = 0
    ignore_eos: bool = False


class RequestLoops(_Message):
    """Loop bounds for looped models (a plain model ignores them)."""

    min_loops: PositiveInt = 1
    max_loops: PositiveInt | None = None
    exit_threshold: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0

    @model_validator(mode="after")
    def _bounds(self) -> RequestLoops:
        if self.max_loops is not None and self.max_loops < self.min_loops:
            raise ValueError(f"max_loops ({self.max_loops}) < min_loops ({self.min_loops})")
        return self


class ChatMessage(_Message):
    role: Annotated[str, Field(min_length=1, max_length=64)]  # system, user, assistant, ...
    content: str


class InferenceRequest(_Message):
    """One generation job: ``prompt`` (token ids, or text when the service has a tokenizer) or
    ``messages`` (a conversation, rendered through the model's chat template); exactly one.

    ``priority``: lower is more important. ``deadline_unix_s``: wall-clock time (seconds since
    the epoch) after which the request is given up with ``finish_reason = "deadline"``.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: RequestId
    prompt: (
        Annotated[list[NonNegativeInt], Field(min_length=1)]
        | Annotated[str, Field(min_length=1)]
        | None
    ) = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    max_tokens: PositiveInt = 16
    # Generation ends (finish_reason "stop") once the text contains one of these; the result's
    # text ends before it. Needs the service's tokenizer.
    stop: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] = Field(
        default_factory=list
    )
    # Each generated token's log-probability and this many most likely alternatives.
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    priority: int = 0
    sampling: RequestSampling = RequestSampling()
    loops: RequestLoops = RequestLoops()
    deadline_unix_s: Annotated[float, Field(gt=0.0)] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> InferenceRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class AbortRequest(_Message):
    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: RequestId


# ------------------------------------------------------------------------------- results


class ResultStatus(StrEnum):
    COMPLETED = "completed"  # generation ended (finish_reason stop or length)
    REJECTED = "rejected"  # never ran: bad input or impossible to serve here (see reason)
    ABORTED = "aborted"  # cancelled (finish_reason abort) or out of time (deadline)
    FAILED = "failed"  # the service could not finish it (see reason)


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    DEADLINE = "deadline"


class Usage(_Message):
    prompt_tokens: NonNegativeInt
    completion_tokens: NonNegativeInt


class Timings(_Message):
    """Seconds from the moment the service read the request."""

    queued_s: Seconds | None = None  # until its first admission to an executor
    time_to_first_token_s: Seconds | None = None
    end_to_end_s: Seconds


class SchedulingFacts(_Message):
    preemptions: NonNegativeInt = 0
    restores: NonNegativeInt = 0
    restore_modes: list[RestoreMode] = Field(default_factory=list)
    bypasses: NonNegativeInt = 0
    recomputed_tokens: NonNegativeInt = 0
    # Executors it ran on, in order; more than one after an executor was lost or drained.
    executors: list[str] = Field(default_factory=list)


class SourceRef(_Message):
    """Where the request was read: results carry it so a duplicate can be recognised."""

    topic: str
    partition: NonNegativeInt
    offset: NonNegativeInt


class RejectCode(StrEnum):
    """Why a record was dead-lettered or a request rejected (the ``kvgate-dlq-code`` header)."""

    TOO_LARGE = "too_large"
    MALFORMED_JSON = "malformed_json"
    SCHEMA = "schema"
    UNSUPPORTED_VERSION = "unsupported_version"
    TEXT_WITHOUT_TOKENIZER = "text_without_tokenizer"
    CHAT_TEMPLATE = "chat_template"  # messages, but no template or one that refuses them
    PROMPT_TOO_LONG = "prompt_too_long"
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    PRIORITY_OUT_OF_RANGE = "priority_out_of_range"
    TOKEN_OUT_OF_VOCABULARY = "token_out_of_vocabulary"
    INFEASIBLE = "infeasible"
    DUPLICATE = "duplicate"


class TokenLogprob(_Message):
    token_id: NonNegativeInt
    logprob: float
    token: str | None = None  # its text alone, when the service has a tokenizer


class OutputLogprobs(_Message):
    """One generated token: its log-probability and the most likely tokens at its position
    (``top``, most likely first), under the model's distribution before temperature and filters.
    """

    token_id: NonNegativeInt
    logprob: float
    token: str | None = None
    top: list[TokenLogprob] = Field(default_factory=list)


class InferenceResult(_Message):
    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: str
    status: ResultStatus
    reason: str | None = None  # why it was rejected or failed
    reject_code: RejectCode | None = None
    finish_reason: FinishReason | None = None
    output_token_ids: list[NonNegativeInt] = Field(default_factory=list)
    text: str | None = None  # when the service has a tokenizer
    logprobs: list[OutputLogprobs] | None = None  # when the request asked for them
    exit_depths: list[PositiveInt] = Field(default_factory=list)
    usage: Usage
    timings: Timings
    scheduling: SchedulingFacts = SchedulingFacts()
    source: SourceRef


class TokenChunk(_Message):
    """One generated token on the optional token stream (in order per request)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: str
    index: NonNegativeInt
    token_id: NonNegativeInt
    exit_depth: PositiveInt


# -------------------------------------------------------------------------- dead letters

DLQ_CODE_HEADER: Final = "kvgate-dlq-code"
DLQ_REASON_HEADER: Final = "kvgate-dlq-reason"
DLQ_TOPIC_HEADER: Final = "kvgate-dlq-topic"
DLQ_PARTITION_HEADER: Final = "kvgate-dlq-partition"
DLQ_OFFSET_HEADER: Final = "kvgate-dlq-offset"
DLQ_TIMESTAMP_HEADER: Final = "kvgate-dlq-timestamp-ms"
TRACEPARENT_HEADER: Final = "traceparent"


class DeadLetter(_Message):
    """What a dead-letter record says about itself (its headers, parsed)."""

    code: RejectCode
    reason: str
    topic: str
    partition: NonNegativeInt
    offset: NonNegativeInt
    timestamp_ms: int | None = None

    def headers(self) -> list[tuple[str, bytes]]:
        headers = [
            (DLQ_CODE_HEADER, self.code.value.encode()),
            (DLQ_REASON_HEADER, self.reason.encode()),
            (DLQ_TOPIC_HEADER, self.topic.encode()),
            (DLQ_PARTITION_HEADER, str(self.partition).encode()),
            (DLQ_OFFSET_HEADER, str(self.offset).encode()),
        ]
        if self.timestamp_ms is not None:
            headers.append((DLQ_TIMESTAMP_HEADER, str(self.timestamp_ms).encode()))
        return headers

    @classmethod
    def from_headers(cls, headers: list[tuple[str, bytes]]) -> DeadLetter:
        found = {k: v.decode() for k, v in headers if k.startswith("kvgate-dlq-")}
        return cls(
            code=RejectCode(found[DLQ_CODE_HEADER]),
            reason=found[DLQ_REASON_HEADER],
            topic=found[DLQ_TOPIC_HEADER],
            partition=int(found[DLQ_PARTITION_HEADER]),
            offset=int(found[DLQ_OFFSET_HEADER]),
            timestamp_ms=(
                int(found[DLQ_TIMESTAMP_HEADER]) if DLQ_TIMESTAMP_HEADER in found else None
            ),
        )
