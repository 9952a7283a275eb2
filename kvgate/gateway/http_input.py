"""What the gateway reads from an HTTP request besides its body's fields: the JSON body itself
(media type, size, pace, nesting), the idempotency key and the client's tracing id; and how a
refused request is answered (an OpenAI error object).

Idempotency comes only from an explicit key: the ``Idempotency-Key`` header (as OpenAI's API and
the IETF draft name it; a quoted structured-field string is unquoted) or kvgate's ``request_id``
body field, scoped to the API key's tenant (:func:`scoped_request_id`): one tenant's key can never
name another tenant's request, so it can never return that request's answer. ``X-Request-Id`` is a
tracing convention that proxies and benchmark tools set on
every request, often to one value: it is echoed in the response and recorded on the span, and
never decides which request runs.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

from aiohttp import hdrs, web

from kvgate.gateway.openai_api import ApiError, bad_field
from kvgate.gateway.settings import GatewaySettings
from kvgate.protocol.records import REQUEST_ID_PATTERN
from kvgate.web.guard import Refusal, read_body
from kvgate.web.json_body import JsonBodyError, parse_json

IDEMPOTENCY_KEY_HEADER: Final = "Idempotency-Key"
REQUEST_ID_HEADER: Final = "X-Request-Id"
# An echoed X-Request-Id: visible ASCII, no spaces, as long as a request id may be; anything
# else is neither echoed nor recorded (and never an error: it is not the client's request).
_TRACE_ID: Final = re.compile(r"[\x21-\x7e]{1,256}")
_JSON_TYPES: Final = re.compile(r"application/(?:[\w.+-]+\+)?json")

# OpenAI-style codes of the refusals made before a body's fields are read.
_CODES: Final = {
    400: "bad_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    414: "uri_too_long",
    415: "unsupported_media_type",
    431: "request_header_fields_too_large",
}


def render_refusal(refusal: Refusal) -> web.Response:
    """A refused request as an OpenAI error object with its status."""
    error = ApiError(refusal.status, refusal.message, code=_CODES.get(refusal.status))
    return web.json_response(error.body(), status=refusal.status, headers=refusal.headers)


async def json_body(request: web.Request, settings: GatewaySettings) -> object:
    """The body as JSON values: ``application/json`` (or none said), UTF-8, within the size,
    time and nesting limits of ``settings``; a 415, 413, 408 or 400 otherwise."""
    content_type = request.headers.get(hdrs.CONTENT_TYPE)
    if content_type is not None:
        media, _, parameters = content_type.partition(";")
        charset = re.search(r"charset\s*=\s*\"?([\w-]+)", parameters, re.IGNORECASE)
        if _JSON_TYPES.fullmatch(media.strip().lower()) is None:
            raise Refusal(415, f"the body must be JSON (Content-Type: application/json), "
                          f"not {media.strip()[:60]!r}")  # fmt: skip
        if charset is not None and charset.group(1).lower() not in ("utf-8", "utf8"):
            raise Refusal(415, f"JSON bodies are UTF-8, not {charset.group(1)[:40]!r}")
    raw = await read_body(request, settings.http_limits)
    try:
        return parse_json(raw, max_depth=settings.max_json_depth)
    except JsonBodyError as exc:
        raise ApiError(400, str(exc), code="invalid_json") from None


def idempotency_key(request: web.Request, body_request_id: str | None) -> str | None:
    """The client's idempotency key: the ``Idempotency-Key`` header or the body's
    ``request_id`` (the same value when both are given); None when neither is."""
    header = request.headers.get(IDEMPOTENCY_KEY_HEADER)
    if header is None:
        return body_request_id
    key = header.strip()
    if len(key) >= 2 and key[0] == key[-1] == '"':
        key = key[1:-1]  # the draft's structured-field string
    if re.fullmatch(REQUEST_ID_PATTERN, key) is None:
        raise bad_field(
            IDEMPOTENCY_KEY_HEADER, f"an idempotency key must match {REQUEST_ID_PATTERN}"
        )
    if body_request_id is not None and body_request_id != key:
        raise bad_field(IDEMPOTENCY_KEY_HEADER, "the Idempotency-Key header and request_id differ")
    return key


# A scoped id is "<key>@<16 hex digits of the tenant's digest>": 17 characters of scope.
_SCOPE_HEX_DIGITS: Final = 16
_MAX_REQUEST_ID_CHARS: Final = 256  # REQUEST_ID_PATTERN's bound


def scoped_request_id(key: str, tenant: str) -> str:
    """The request record's id for an idempotency key sent by ``tenant``: the key, ``@``, and a
    digest of the tenant, so equal keys of two tenants are two requests. A key too long to keep
    whole beside its scope is replaced by its SHA-256 (64 hex digits): still one id per key."""
    scope = hashlib.sha256(tenant.encode()).hexdigest()[:_SCOPE_HEX_DIGITS]
    if len(key) + 1 + _SCOPE_HEX_DIGITS > _MAX_REQUEST_ID_CHARS:
        key = hashlib.sha256(key.encode()).hexdigest()
    return f"{key}@{scope}"


def client_trace_id(request: web.Request) -> str | None:
    """The client's ``X-Request-Id`` when it is fit to echo (see ``_TRACE_ID``), else None."""
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is None or _TRACE_ID.fullmatch(value) is None:
        return None
    return value
