"""Parse at the boundary: a raw Kafka record becomes a typed request or a typed rejection.

Checks, in order (the first failure decides the reason)::

    size ≤ max_message_bytes → UTF-8 (no byte-order mark) → JSON (RFC 8259: no NaN or
    Infinity) object → schema_version the integer 1 → InferenceRequest schema (exact types)
    → text prompt or messages only with a tokenizer, and ≤ max_prompt_chars → stop strings
    only with a tokenizer → (text: messages through the chat template, then tokenized, off the
    event loop, see ``intake.py``) → prompt ≤ max_prompt_tokens → max_tokens ≤ limit
    → priority in [priority_min, priority_max] → the structured output or forced tool call's
    grammar accepted by the grammar engine (compiled once per distinct grammar, cached)

Capacity (fits an executor's cache, token ids inside its vocabulary) and duplicate in-flight ids
are checked where that knowledge lives, at placement. A rejection carries the request id when
one can be read — from the body, else from the record key — so a ``rejected`` result can be
produced for it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pydantic import ValidationError

from kvgate.admission_service.chat import ChatTemplateError
from kvgate.admission_service.settings import LimitsSettings
from kvgate.admission_service.tokenizer import TextCodec
from kvgate.admission_service.tool_calls import request_grammar
from kvgate.grammar import grammar_problem
from kvgate.protocol.records import (
    REQUEST_ID_PATTERN,
    SCHEMA_VERSION,
    TRACEPARENT_HEADER,
    AbortRequest,
    InferenceRequest,
    RejectCode,
    ReplyTo,
)
from kvgate.protocol.step import LoopParams, SamplingParams
from kvgate.scheduler.request import RequestSpec

_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


@dataclass(frozen=True, slots=True)
class RawRecord:
    """A consumed Kafka record, as the service needs it (independent of the client library)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp_ms: int | None = None

    def header(self, name: str) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def traceparent(self) -> str | None:
        raw = self.header(TRACEPARENT_HEADER)
        if raw is None:
            return None
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            return None


@dataclass(frozen=True, slots=True)
class Accepted:
    request: InferenceRequest
    prompt_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NeedsTokens:
    """A valid request whose text prompt or messages must be tokenized before its last checks
    (:func:`tokenized`)."""

    request: InferenceRequest


@dataclass(frozen=True, slots=True)
class Rejection:
    code: RejectCode
    reason: str
    request_id: str | None
    # The sender's reply address when it could be read (a rejection goes there too), taken
    # from the parse that judged the record: the record is never parsed again to find it.
    reply: ReplyTo | None = None


def _readable_id(candidate: object) -> str | None:
    if isinstance(candidate, str) and _REQUEST_ID.match(candidate):
        return candidate
    return None


def _readable_reply(body: dict[str, object]) -> ReplyTo | None:
    try:
        return ReplyTo.model_validate(body.get("reply"))
    except ValidationError:
        return None


def _key_id(record: RawRecord) -> str | None:
    if record.key is None:
        return None
    try:
        return _readable_id(record.key.decode("utf-8"))
    except UnicodeDecodeError:
        return None


def describe_schema_error(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:3]:
        where = ".".join(str(p) for p in item["loc"]) or "(body)"
        parts.append(f"{where}: {item['msg']}")
    more = len(error.errors()) - 3
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


_UTF8_BOM = b"\xef\xbb\xbf"
_UTF32_BOMS = (b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def _encoding_problem(value: bytes) -> str | None:
    """Why ``value`` is not UTF-8 text, in the terms a producer can act on (None if it is)."""
    if value.startswith(_UTF8_BOM):
        return "the body starts with a UTF-8 byte-order mark; send UTF-8 JSON without one"
    head = value[:4]
    if head.startswith(_UTF32_BOMS) or (len(head) == 4 and head.count(0) == 3):
        return "the body is UTF-32 encoded; send UTF-8 JSON"
    if head.startswith(_UTF16_BOMS) or 0 in head[:2]:
        return "the body is UTF-16 encoded; send UTF-8 JSON"
    try:
        value.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"the body is not UTF-8: byte {exc.start} ({value[exc.start]:#04x}) is invalid"
    return None


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number (RFC 8259)")


def _version_problem(body: dict[str, object]) -> Rejection | None:
    if "schema_version" not in body:
        return None
    version = body["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int):
        shown = f"the string {version!r}" if isinstance(version, str) else json.dumps(version)
        return Rejection(
            RejectCode.SCHEMA,
            f"schema_version must be the integer {SCHEMA_VERSION}, not {shown}",
            None,
        )
    if version != SCHEMA_VERSION:
        return Rejection(
            RejectCode.UNSUPPORTED_VERSION,
            f"schema_version {version} is not supported (this service reads {SCHEMA_VERSION})",
            None,
        )
    return None


def _parse_object(record: RawRecord, max_bytes: int) -> dict[str, object] | Rejection:
    value = record.value
    if value is None:
        return Rejection(RejectCode.MALFORMED_JSON, "the record has no value", _key_id(record))
    if len(value) > max_bytes:
        return Rejection(
            RejectCode.TOO_LARGE,
            f"the record is {len(value)} bytes; limits.max_message_bytes is {max_bytes}",
            _key_id(record),
        )
    problem = _encoding_problem(value)
    if problem is not None:
        return Rejection(RejectCode.MALFORMED_JSON, problem, _key_id(record))
    try:
        body = json.loads(value, parse_constant=_no_constants)
    except json.JSONDecodeError as exc:
        return Rejection(RejectCode.MALFORMED_JSON, f"not JSON: {exc}", _key_id(record))
    except ValueError as exc:  # NaN or Infinity
        return Rejection(RejectCode.MALFORMED_JSON, f"not JSON: {exc}", _key_id(record))
    except RecursionError:
        # Hostile nesting: the parser's depth limit, not a reason to stop consuming.
        return Rejection(
            RejectCode.MALFORMED_JSON, "JSON nested too deeply to be read", _key_id(record)
        )
    if not isinstance(body, dict):
        return Rejection(
            RejectCode.SCHEMA,
            f"the body must be a JSON object, not {type(body).__name__}",
            _key_id(record),
        )
    version = _version_problem(body)
    if version is not None:
        request_id = _readable_id(body.get("request_id")) or _key_id(record)
        return Rejection(version.code, version.reason, request_id, _readable_reply(body))
    return body


def validate_request(
    record: RawRecord, limits: LimitsSettings, tokenizer: TextCodec | None
) -> Accepted | Rejection:
    """Every check, tokenizing a text prompt here (tools and tests; the service tokenizes
    off its event loop through :func:`check_request` and :func:`complete_text`)."""
    verdict = check_request(record, limits, has_tokenizer=tokenizer is not None)
    if isinstance(verdict, NeedsTokens):
        assert tokenizer is not None
        return tokenized(verdict, tokenizer, limits)
    return verdict


def check_request(
    record: RawRecord, limits: LimitsSettings, *, has_tokenizer: bool
) -> Accepted | NeedsTokens | Rejection:
    """Every check that needs no tokenizer; a text prompt comes back as :class:`NeedsTokens`."""
    value = record.value
    request: InferenceRequest | None = None
    if value is not None and len(value) <= limits.max_message_bytes:
        try:  # the hot path: one parse in pydantic's core
            request = InferenceRequest.model_validate_json(value)
        except ValidationError:
            request = None
    if request is None:
        return _classify_bad_request(record, limits.max_message_bytes)
    rid = request.request_id
    if request.stop and not has_tokenizer:
        return Rejection(
            RejectCode.TEXT_WITHOUT_TOKENIZER,
            "stop strings need text, and this service has no tokenizer "
            "(configure limits.tokenizer_file)",
            rid,
            request.reply,
        )
    if isinstance(request.prompt, list):
        return _checked(request, tuple(request.prompt), limits)
    if not has_tokenizer:
        return Rejection(
            RejectCode.TEXT_WITHOUT_TOKENIZER,
            f"the {'prompt is text' if request.prompt else 'request has messages'} but this "
            "service has no tokenizer (send token ids, or configure limits.tokenizer_file)",
            rid,
            request.reply,
        )
    chars = _text_chars(request)
    if chars > limits.prompt_char_limit:
        return Rejection(
            RejectCode.PROMPT_TOO_LONG,
            f"the prompt has {chars} characters; at most {limits.prompt_char_limit} are "
            "tokenized (limits.max_prompt_chars)",
            rid,
            request.reply,
        )
    return NeedsTokens(request)


def _text_chars(request: InferenceRequest) -> int:
    if request.messages is not None:
        return sum(len(message.content or "") for message in request.messages)
    return len(request.prompt or "")


def prompt_token_ids(codec: TextCodec, request: InferenceRequest) -> list[int]:
    """A text request's prompt tokens: its text, or its messages through the chat template
    (raises ChatTemplateError). Slow for long texts: the service runs it off its event loop."""
    if request.messages is not None:
        return codec.encode(codec.render_chat(request.messages, request.tools))
    assert isinstance(request.prompt, str)
    return codec.encode(request.prompt)


def tokenized(
    pending: NeedsTokens, codec: TextCodec, limits: LimitsSettings
) -> Accepted | Rejection:
    """Tokenize a pending text request and finish its checks (on whatever thread calls it)."""
    try:
        token_ids = prompt_token_ids(codec, pending.request)
    except ChatTemplateError as exc:
        request = pending.request
        return Rejection(RejectCode.CHAT_TEMPLATE, str(exc), request.request_id, request.reply)
    return complete_text(pending, token_ids, limits)


def complete_text(
    pending: NeedsTokens, token_ids: list[int], limits: LimitsSettings
) -> Accepted | Rejection:
    """The checks left for a text prompt once it is tokenized."""
    if not token_ids:
        request = pending.request
        return Rejection(
            RejectCode.SCHEMA,
            "the prompt text encodes to no tokens",
            request.request_id,
            request.reply,
        )
    return _checked(pending.request, tuple(token_ids), limits)


def _checked(
    request: InferenceRequest, token_ids: tuple[int, ...], limits: LimitsSettings
) -> Accepted | Rejection:
    rid = request.request_id
    if len(token_ids) > limits.max_prompt_tokens:
        return Rejection(
            RejectCode.PROMPT_TOO_LONG,
            f"the prompt has {len(token_ids)} tokens; limits.max_prompt_tokens is "
            f"{limits.max_prompt_tokens}",
            rid,
            request.reply,
        )
    if request.max_tokens > limits.max_output_tokens:
        return Rejection(
            RejectCode.MAX_TOKENS_TOO_LARGE,
            f"max_tokens {request.max_tokens} exceeds limits.max_output_tokens "
            f"{limits.max_output_tokens}",
            rid,
            request.reply,
        )
    if not limits.priority_min <= request.priority <= limits.priority_max:
        return Rejection(
            RejectCode.PRIORITY_OUT_OF_RANGE,
            f"priority {request.priority} is outside [{limits.priority_min}, "
            f"{limits.priority_max}]",
            rid,
            request.reply,
        )
    grammar = request_grammar(request)
    if grammar is not None:
        problem = grammar_problem(grammar)
        if problem is not None:
            what = "the forced tool call" if request.forces_tool_call else "structured_output"
            return Rejection(RejectCode.STRUCTURED_OUTPUT, f"{what}: {problem}", rid, request.reply)
    return Accepted(request, token_ids)


def _classify_bad_request(record: RawRecord, max_bytes: int) -> Rejection:
    """Why a record is not a valid request (the slow path, run only for bad input)."""
    body = _parse_object(record, max_bytes)
    if isinstance(body, Rejection):
        return body
    request_id = _readable_id(body.get("request_id")) or _key_id(record)
    reply = _readable_reply(body)
    try:
        # From JSON text, as the hot path parses: object keys (logit_bias's token ids) are text.
        InferenceRequest.model_validate_json(json.dumps(body))
    except ValidationError as exc:
        return Rejection(RejectCode.SCHEMA, describe_schema_error(exc), request_id, reply)
    # JSON that parses as a dict and validates as one, but not from bytes: e.g. duplicate keys.
    return Rejection(
        RejectCode.SCHEMA, "the body does not match the request schema", request_id, reply
    )


def validate_abort(record: RawRecord, max_bytes: int) -> AbortRequest | Rejection:
    body = _parse_object(record, max_bytes)
    if isinstance(body, Rejection):
        return body
    try:
        return AbortRequest.model_validate(body)
    except ValidationError as exc:
        return Rejection(RejectCode.SCHEMA, describe_schema_error(exc), None)


def build_spec(accepted: Accepted, traceparent: str | None) -> RequestSpec:
    """The scheduler's view of an accepted request (choice 0's, for ``n > 1``).

    The step protocol's SamplingParams/LoopParams are built without validating again:
    ``InferenceRequest`` enforced the same bounds on the same fields at the boundary. A request
    that only scores its prompt (``max_tokens: 0``) runs with one output, which its result drops
    (``outputs.shaped``): the scheduler finishes a request on a token.
    """
    request = accepted.request
    sampling = request.sampling
    loops = request.loops
    return RequestSpec(
        request_id=request.request_id,
        prompt_token_ids=accepted.prompt_token_ids,
        sampling=SamplingParams.model_construct(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            seed=sampling.seed,
            max_tokens=max(request.max_tokens, 1),
            ignore_eos=sampling.ignore_eos,
            min_tokens=sampling.min_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=sampling.repetition_penalty,
            logit_bias=dict(sampling.logit_bias),
            grammar=request_grammar(request),
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
        ),
        loops=LoopParams.model_construct(
            min_loops=loops.min_loops,
            max_loops=loops.max_loops,
            exit_threshold=loops.exit_threshold,
            exit_trace=None,
        ),
        priority=request.priority,
        deadline_s=request.deadline_unix_s,
        traceparent=traceparent,
    )
