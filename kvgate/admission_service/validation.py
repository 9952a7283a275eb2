"""Parse at the boundary: a raw Kafka record becomes a typed request or a typed rejection.

Checks, in order (the first failure decides the reason)::

    size ≤ max_message_bytes → JSON object → schema_version known → InferenceRequest schema
    → text prompt or messages only with a tokenizer (messages: through its chat template)
    → prompt ≤ max_prompt_tokens → max_tokens ≤ limit → priority in [priority_min, priority_max]

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
from kvgate.admission_service.messages import (
    REQUEST_ID_PATTERN,
    SCHEMA_VERSION,
    TRACEPARENT_HEADER,
    AbortRequest,
    InferenceRequest,
    RejectCode,
)
from kvgate.admission_service.scheduler.request import RequestSpec
from kvgate.admission_service.settings import LimitsSettings
from kvgate.admission_service.tokenizer import TextCodec
from kvgate.gpu_executor.api import LoopParams, SamplingParams

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
class Rejection:
    code: RejectCode
    reason: str
    request_id: str | None


def _readable_id(candidate: object) -> str | None:
    if isinstance(candidate, str) and _REQUEST_ID.match(candidate):
        return candidate
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
    try:
        body = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
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
    version = body.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        return Rejection(
            RejectCode.UNSUPPORTED_VERSION,
            f"schema_version {version!r} is not supported (this service reads {SCHEMA_VERSION})",
            _readable_id(body.get("request_id")) or _key_id(record),
        )
    return body


def validate_request(
    record: RawRecord, limits: LimitsSettings, tokenizer: TextCodec | None
) -> Accepted | Rejection:
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
    if isinstance(request.prompt, list):
        token_ids = tuple(request.prompt)
    else:
        if tokenizer is None:
            return Rejection(
                RejectCode.TEXT_WITHOUT_TOKENIZER,
                f"the {'prompt is text' if request.prompt else 'request has messages'} but this "
                "service has no tokenizer (send token ids, or configure limits.tokenizer_file)",
                rid,
            )
        text = request.prompt
        if request.messages is not None:
            try:
                text = tokenizer.render_chat(request.messages)
            except ChatTemplateError as exc:
                return Rejection(RejectCode.CHAT_TEMPLATE, str(exc), rid)
        token_ids = tuple(tokenizer.encode(text or ""))
        if not token_ids:
            return Rejection(RejectCode.SCHEMA, "the prompt text encodes to no tokens", rid)
    if request.stop and tokenizer is None:
        return Rejection(
            RejectCode.TEXT_WITHOUT_TOKENIZER,
            "stop strings need text, and this service has no tokenizer "
            "(configure limits.tokenizer_file)",
            rid,
        )
    if len(token_ids) > limits.max_prompt_tokens:
        return Rejection(
            RejectCode.PROMPT_TOO_LONG,
            f"the prompt has {len(token_ids)} tokens; limits.max_prompt_tokens is "
            f"{limits.max_prompt_tokens}",
            rid,
        )
    if request.max_tokens > limits.max_output_tokens:
        return Rejection(
            RejectCode.MAX_TOKENS_TOO_LARGE,
            f"max_tokens {request.max_tokens} exceeds limits.max_output_tokens "
            f"{limits.max_output_tokens}",
            rid,
        )
    if not limits.priority_min <= request.priority <= limits.priority_max:
        return Rejection(
            RejectCode.PRIORITY_OUT_OF_RANGE,
            f"priority {request.priority} is outside [{limits.priority_min}, "
            f"{limits.priority_max}]",
            rid,
        )
    return Accepted(request, token_ids)


def _classify_bad_request(record: RawRecord, max_bytes: int) -> Rejection:
    """Why a record is not a valid request (the slow path, run only for bad input)."""
    body = _parse_object(record, max_bytes)
    if isinstance(body, Rejection):
        return body
    request_id = _readable_id(body.get("request_id")) or _key_id(record)
    try:
        InferenceRequest.model_validate(body)
    except ValidationError as exc:
        return Rejection(RejectCode.SCHEMA, describe_schema_error(exc), request_id)
    # JSON that parses as a dict and validates as one, but not from bytes: e.g. duplicate keys.
    return Rejection(RejectCode.SCHEMA, "the body does not match the request schema", request_id)


def validate_abort(record: RawRecord, max_bytes: int) -> AbortRequest | Rejection:
    body = _parse_object(record, max_bytes)
    if isinstance(body, Rejection):
        return body
    try:
        return AbortRequest.model_validate(body)
    except ValidationError as exc:
        return Rejection(RejectCode.SCHEMA, describe_schema_error(exc), None)


def build_spec(accepted: Accepted, traceparent: str | None) -> RequestSpec:
    """The scheduler's view of an accepted request.

    The step protocol's SamplingParams/LoopParams are built without validating again:
    ``InferenceRequest`` enforced the same bounds on the same fields at the boundary.
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
            seed=sampling.seed,
            max_tokens=request.max_tokens,
            ignore_eos=sampling.ignore_eos,
            logprobs=request.logprobs,
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
