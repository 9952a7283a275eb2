"""Kafka message bodies: requests in, results and token chunks out, aborts, dead letters.

Every body is UTF-8 JSON validated by a pydantic model with ``extra="forbid"`` and a
``schema_version``; what producers send is validated strictly (exact JSON types, finite
numbers). A producer that sends a field this version does not know is told so in the
dead-letter reason instead of having it silently ignored.

Topics, keys and headers: :mod:`kvgate.protocol.topics`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvgate.protocol.enums import FinishReason, RestoreMode

SCHEMA_VERSION: Final = 1
REQUEST_ID_PATTERN: Final = r"^[A-Za-z0-9._:/@+=-]{1,256}$"

# Reply topics live in their own namespace so that a request cannot make the service write into
# its own topics (or anyone else's).
REPLY_TOPIC_PATTERN: Final = r"^kvgate\.replies\.[a-zA-Z0-9._-]{1,200}$"

RequestId = Annotated[str, Field(pattern=REQUEST_ID_PATTERN)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(ge=0.0)]


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Input(_Message):
    """What producers send: exact wire types (no ``"4"`` or ``true`` for an integer, no
    ``1.0`` for one either) and finite numbers only."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("schema_version", mode="before", check_fields=False)
    @classmethod
    def _integer_version(cls, value: object) -> object:
        if isinstance(value, bool):  # a Literal[1] would take True (True == 1)
            raise ValueError(f"schema_version must be the integer {SCHEMA_VERSION}, not a boolean")
        return value


# ------------------------------------------------------------------------------ requests


class RequestSampling(_Input):
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: PositiveInt | None = None
    # Set: the same prompt, settings and seed draw the same tokens whatever the request id (as
    # vLLM's per-request seed). Unset: every request draws afresh (keyed by its id).
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    ignore_eos: bool = False


class RequestLoops(_Input):
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


class ReplyTo(_Input):
    """Where a gateway wants its answers, besides the results topic: a topic of the reply
    namespace (``kvgate.replies.*``, never a topic of the service) and one of its partitions.

    The result is written to the results topic as always (the source of truth, read by the
    results scan) and a copy to ``topic``/``partition``; with ``tokens`` every generated token
    goes there too. A reply address the service cannot find is skipped, never retried: the
    answer in the results topic stays the one that counts.
    """

    topic: Annotated[str, Field(max_length=249, pattern=REPLY_TOPIC_PATTERN)]
    partition: Annotated[int, Field(ge=0, le=99_999)] = 0
    tokens: bool = False


class InferenceRequest(_Input):
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
    reply: ReplyTo | None = None  # a gateway's own reply address (answers are copied there)

    @model_validator(mode="after")
    def _one_prompt(self) -> InferenceRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class AbortRequest(_Input):
    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: RequestId


# ------------------------------------------------------------------------------- results


class ResultStatus(StrEnum):
    COMPLETED = "completed"  # generation ended (finish_reason stop or length)
    REJECTED = "rejected"  # never ran: bad input or impossible to serve here (see reason)
    ABORTED = "aborted"  # cancelled (finish_reason abort) or out of time (deadline)
    FAILED = "failed"  # the service could not finish it (see reason)


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

# On records written to a reply topic: which model the value is ("result" or "token").
REPLY_KIND_HEADER: Final = "kvgate-reply-kind"

DLQ_CODE_HEADER: Final = "kvgate-dlq-code"
DLQ_REASON_HEADER: Final = "kvgate-dlq-reason"
DLQ_TOPIC_HEADER: Final = "kvgate-dlq-topic"
DLQ_PARTITION_HEADER: Final = "kvgate-dlq-partition"
DLQ_OFFSET_HEADER: Final = "kvgate-dlq-offset"
DLQ_TIMESTAMP_HEADER: Final = "kvgate-dlq-timestamp-ms"
# Only on a dead letter whose original did not fit the dead-letter topic: its value is then a
# prefix of the original, and these describe the whole original value.
DLQ_TRUNCATED_HEADER: Final = "kvgate-dlq-truncated"
DLQ_ORIGINAL_BYTES_HEADER: Final = "kvgate-dlq-original-bytes"
DLQ_SHA256_HEADER: Final = "kvgate-dlq-sha256"
TRACEPARENT_HEADER: Final = "traceparent"


class DeadLetter(_Message):
    """What a dead-letter record says about itself (its headers, parsed).

    ``truncated``: the record carries only a prefix of the original value (and no original key
    or headers when those were too large too); ``original_bytes`` and ``sha256`` describe the
    whole original value, and topic/partition/offset say where to read it.
    """

    code: RejectCode
    reason: str
    topic: str
    partition: NonNegativeInt
    offset: NonNegativeInt
    timestamp_ms: int | None = None
    truncated: bool = False
    original_bytes: NonNegativeInt | None = None
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None

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
        if self.truncated:
            headers.append((DLQ_TRUNCATED_HEADER, b"true"))
        if self.original_bytes is not None:
            headers.append((DLQ_ORIGINAL_BYTES_HEADER, str(self.original_bytes).encode()))
        if self.sha256 is not None:
            headers.append((DLQ_SHA256_HEADER, self.sha256.encode()))
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
            truncated=found.get(DLQ_TRUNCATED_HEADER) == "true",
            original_bytes=(
                int(found[DLQ_ORIGINAL_BYTES_HEADER])
                if DLQ_ORIGINAL_BYTES_HEADER in found
                else None
            ),
            sha256=found.get(DLQ_SHA256_HEADER),
        )
