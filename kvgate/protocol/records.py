"""Kafka message bodies: requests in, results and token chunks out, aborts, dead letters.

Every body is UTF-8 JSON validated by a pydantic model with ``extra="forbid"`` and a
``schema_version``; what producers send is validated strictly (exact JSON types, finite
numbers). A producer that sends a field this version does not know is told so in the
dead-letter reason instead of having it silently ignored.

Topics, keys and headers: :mod:`kvgate.protocol.topics`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvgate.protocol.enums import FinishReason, RestoreMode
from kvgate.protocol.stopping import DEFAULT_MAX_TOKENS
from kvgate.protocol.structured import StructuredOutput
from kvgate.protocol.tenants import TenantName
from kvgate.protocol.tools import (
    MAX_TOOLS,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolDefinition,
)

SCHEMA_VERSION: Final = 1
REQUEST_ID_PATTERN: Final = r"^[A-Za-z0-9._:/@+=-]{1,256}$"

# Reply topics live in their own namespace so that a request cannot make the service write into
# its own topics (or anyone else's).
REPLY_TOPIC_PATTERN: Final = r"^kvgate\.replies\.[a-zA-Z0-9._-]{1,200}$"

RequestId = Annotated[str, Field(pattern=REQUEST_ID_PATTERN)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(ge=0.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]

MAX_CHOICES: Final = 16  # n: choices of one request
MAX_LOGIT_BIAS: Final = 1024  # entries of logit_bias
MAX_STOP_TOKEN_IDS: Final = 64


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
    """How tokens are drawn; every field means what vLLM's sampling parameter of that name means.

    Order of application to one row's logits: the structured-output mask, ``logit_bias``,
    ``min_tokens`` (the EOS and ``stop_token_ids`` masked until that many outputs), the
    repetition, frequency and presence penalties, then temperature, ``min_p``, ``top_k``,
    ``top_p`` and one seeded draw (``kvgate.executor.sampler``).
    """

    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: PositiveInt | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    # Set: the same prompt, settings and seed draw the same tokens whatever the request id (as
    # vLLM's per-request seed). Unset: every request draws afresh (keyed by its id). With n > 1
    # each choice draws from its own stream of the seed.
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    ignore_eos: bool = False
    # Subtracted once from a token's logit if it occurs among the outputs (presence), and per
    # occurrence (frequency); OpenAI's ranges.
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # Logits of tokens in the prompt or the outputs divided by it when positive, multiplied when
    # negative (the CTRL rule, as vLLM and transformers apply it); 1 is off.
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    # Added to a token's logit before anything else but the mask (OpenAI: -100 bans, 100 forces).
    logit_bias: Annotated[
        dict[NonNegativeInt, Annotated[float, Field(ge=-100.0, le=100.0)]],
        Field(max_length=MAX_LOGIT_BIAS),
    ] = Field(default_factory=dict)
    # The EOS and stop_token_ids cannot end the request before this many outputs.
    min_tokens: NonNegativeInt = 0
    # Tokens that end the request like the EOS (finish_reason "stop"; the token is an output).
    stop_token_ids: Annotated[list[NonNegativeInt], Field(max_length=MAX_STOP_TOKEN_IDS)] = Field(
        default_factory=list
    )


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
    """One turn of a conversation: system, user, assistant (text, or the tool calls it made) or
    tool (a call's result, naming the call in ``tool_call_id``)."""

    role: Annotated[str, Field(min_length=1, max_length=64)]  # system, user, assistant, tool, ...
    content: str | None = None  # None only for an assistant turn that made tool calls
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs content (or tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return self


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


# The batches' class: every batch line's priority unless its settings say otherwise, and the
# admission service's background class (the scheduler's ``background_priority``).
BATCH_PRIORITY: Final = 100


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
    # 0 only scores the prompt (with prompt_logprobs): nothing is generated.
    max_tokens: NonNegativeInt = DEFAULT_MAX_TOKENS
    # Generation ends (finish_reason "stop") once the text contains one of these; the result's
    # text ends before it. Needs the service's tokenizer.
    stop: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] = Field(
        default_factory=list
    )
    # Each generated token's log-probability and this many most likely alternatives.
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Each prompt token's log-probability given the tokens before it, and this many alternatives
    # (prompt scoring; the prompt is computed in full, never taken from the prefix cache).
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Independent choices for the same prompt: one prefill shared through the prefix cache,
    # each choice its own draws (``choices`` in the result).
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    priority: int = 0
    sampling: RequestSampling = RequestSampling()
    loops: RequestLoops = RequestLoops()
    structured_output: StructuredOutput | None = None
    # Functions the model may call (messages only): rendered by the chat template; tool_choice
    # "required" or a named function is forced by the structured-output mask, "auto" is parsed
    # from the model's own format. Default choice: "auto" with tools, "none" without.
    tools: Annotated[list[ToolDefinition], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    deadline_unix_s: Annotated[float, Field(gt=0.0)] | None = None
    reply: ReplyTo | None = None  # a gateway's own reply address (answers are copied there)
    # Whose share it is served from (fair sharing, quotas; a gateway sets its API key's tenant),
    # and a hint that requests with the same key share a prompt prefix (placement; a gateway
    # maps OpenAI's prompt_cache_key, else user).
    tenant: TenantName | None = None
    affinity_key: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> InferenceRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.sampling.min_tokens > self.max_tokens:
            raise ValueError(
                f"sampling.min_tokens ({self.sampling.min_tokens}) > max_tokens ({self.max_tokens})"
            )
        if self.max_tokens == 0 and (self.prompt_logprobs is None or self.n > 1):
            raise ValueError("max_tokens 0 only scores the prompt: give prompt_logprobs and n 1")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools need messages (the chat template renders them)")
        # A forced tool call with a structured output: the call is the output (the structured
        # output shapes text, which a forced call leaves none of), as OpenAI's API has it.
        if self.tool_choice not in (None, ToolChoiceMode.NONE) and self.tools is None:
            raise ValueError("tool_choice needs tools")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if (
            choice is not None
            and not isinstance(choice, ToolChoiceMode)
            and choice.name not in names
        ):
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        return self

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """What the request asked for, with OpenAI's default: auto with tools, none without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return ToolChoiceMode.AUTO if self.tools else ToolChoiceMode.NONE

    @property
    def forces_tool_call(self) -> bool:
        """Whether the output must be tool calls (required, or one named function)."""
        return self.tools is not None and self.effective_tool_choice not in (
            ToolChoiceMode.NONE,
            ToolChoiceMode.AUTO,
        )


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
    # A structured output (schema, regex, choice, grammar) or tool the grammar engine refuses,
    # or one this pool cannot enforce (its model has no tokenizer or no EOS).
    STRUCTURED_OUTPUT = "structured_output"
    QUOTA_EXCEEDED = "quota_exceeded"  # its tenant's tokens-per-minute quota has no room now


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


class PromptLogprob(_Message):
    """One prompt token: its log-probability given the tokens before it (None for the first,
    which has no context) and the most likely tokens at its position."""

    token_id: NonNegativeInt
    logprob: float | None = None  # None (or absent, as written without nulls): the first token
    token: str | None = None
    top: list[TokenLogprob] = Field(default_factory=list)


class Choice(_Message):
    """One of the ``n`` choices of a request (``InferenceResult.choices``)."""

    index: NonNegativeInt
    finish_reason: FinishReason | None = None
    output_token_ids: list[NonNegativeInt] = Field(default_factory=list)
    text: str | None = None
    logprobs: list[OutputLogprobs] | None = None
    tool_calls: list[ToolCall] | None = None
    exit_depths: list[PositiveInt] = Field(default_factory=list)


class InferenceResult(_Message):
    """The answer to one request. With ``n > 1`` the top-level fields are choice 0's and
    ``choices`` holds every choice in index order (``usage.completion_tokens`` counts them all).

    ``tool_calls`` (``finish_reason`` ``tool_calls``): the calls the model made; ``text`` is then
    what it wrote besides them (None when nothing).
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: str
    status: ResultStatus
    reason: str | None = None  # why it was rejected or failed
    reject_code: RejectCode | None = None
    finish_reason: FinishReason | None = None
    output_token_ids: list[NonNegativeInt] = Field(default_factory=list)
    text: str | None = None  # when the service has a tokenizer
    logprobs: list[OutputLogprobs] | None = None  # when the request asked for them
    tool_calls: list[ToolCall] | None = None
    choices: list[Choice] | None = None  # n > 1
    prompt_logprobs: list[PromptLogprob] | None = None  # when the request asked for them
    exit_depths: list[PositiveInt] = Field(default_factory=list)
    usage: Usage
    timings: Timings
    scheduling: SchedulingFacts = SchedulingFacts()
    source: SourceRef


class TokenChunk(_Message):
    """One generated token on the optional token stream (in order per request and choice)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: str
    index: NonNegativeInt
    token_id: NonNegativeInt
    exit_depth: PositiveInt
    choice: NonNegativeInt = 0  # which of the request's n choices
    # When the request asked for logprobs: the token's and its alternatives' (no text: a reader
    # with the tokenizer decodes them, the result carries the text).
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None


# A chunk as the service streams it (``stream_json``): JSON without its schema version (the
# record holding it says it once) and without fields left at None.
_STREAM_LEFT_OUT: Final = {"schema_version"}


def stream_json(chunk: TokenChunk) -> str:
    """``chunk`` as a stream record holds it (any chunk; ``plain_chunk_json`` is the same text
    for one without log-probabilities, made without a model)."""
    return chunk.model_dump_json(exclude_none=True, exclude=_STREAM_LEFT_OUT)


def chunk_head(request_id: str) -> str:
    """What every streamed chunk of ``request_id`` starts with (made once per request)."""
    return '{"request_id":' + json.dumps(request_id) + ',"index":'


def plain_chunk_json(head: str, index: int, token_id: int, exit_depth: int, choice: int) -> str:
    """``stream_json`` of a chunk without log-probabilities whose request's ``chunk_head`` is
    ``head``: the service makes one per streamed token, so no model and no validation (its
    values come from step results validated when they were read)."""
    return f'{head}{index},"token_id":{token_id},"exit_depth":{exit_depth},"choice":{choice}}}'


class TokenRecords(StrEnum):
    """How a token stream is written: a record per step and topic partition (``TokenChunks``),
    or a record per token (``TokenChunk``), for consumers written before the batches."""

    PER_STEP = "per_step"
    PER_TOKEN = "per_token"


class TokenChunks(_Message):
    """One record of the token stream: the chunks one step made for one topic partition (of
    several requests, each request's in order), instead of a record per token."""

    schema_version: Literal[1] = SCHEMA_VERSION
    chunks: list[TokenChunk] = Field(min_length=1)


# -------------------------------------------------------------------------- dead letters

# On records written to a reply topic: which model the value is.
REPLY_KIND_HEADER: Final = "kvgate-reply-kind"
REPLY_KIND_RESULT: Final = b"result"  # an InferenceResult
REPLY_KIND_TOKEN: Final = b"token"  # a TokenChunk (one token: a service's per_token records)
REPLY_KIND_TOKENS: Final = b"tokens"  # a TokenChunks (a step's tokens; on the token topic too)
TOKEN_KINDS: Final = frozenset({REPLY_KIND_TOKEN, REPLY_KIND_TOKENS})


def reply_kind(headers: Iterable[tuple[str, bytes]]) -> bytes | None:
    """A record's ``REPLY_KIND_HEADER`` value (None without one)."""
    return next((value for name, value in headers if name == REPLY_KIND_HEADER), None)


def token_chunks_of(kind: bytes | None, value: bytes) -> list[TokenChunk]:
    """The chunks of one token-stream record whose ``REPLY_KIND_HEADER`` is ``kind``: a
    ``TokenChunks`` (``tokens``), else a single ``TokenChunk`` (``token``, or no header: the
    token topic of a service writing a record per token). Raises pydantic's ValidationError."""
    if kind == REPLY_KIND_TOKENS:
        return TokenChunks.model_validate_json(value).chunks
    return [TokenChunk.model_validate_json(value)]


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
