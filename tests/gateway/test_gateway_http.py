"""The gateway's HTTP input, in process: JSON bodies read with a nesting limit, the idempotency
key (``Idempotency-Key`` or ``request_id``, never ``X-Request-Id``), the client's X-Request-Id
echoed and traced, refusals classified and answered as OpenAI error objects, and per-replica
rate limits that add up to the configured one."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import pytest
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvgate.gateway.auth import RateLimiter
from kvgate.gateway.http_input import client_trace_id, idempotency_key, scoped_request_id
from kvgate.gateway.openai_api import ApiError
from kvgate.gateway.server import Gateway
from kvgate.gateway.settings import ApiKey, GatewaySettings, ModelRoute
from kvgate.kafka_connection import KafkaConnection
from kvgate.protocol.records import REQUEST_ID_PATTERN, InferenceRequest
from kvgate.telemetry import attributes as attr
from kvgate.web.guard import HttpLimits, malformed_status
from kvgate.web.json_body import JsonBodyError, closes_within, parse_json

KEY = ApiKey(name="k", key="sk-http-0123456789abcdef")
AUTH = {"Authorization": f"Bearer {KEY.key}"}
JSON = {"Content-Type": "application/json"}


# ------------------------------------------------------------------------- JSON bodies


def _nested(depth: int) -> bytes:
    return b'{"a": ' + b"[" * (depth - 1) + b"1" + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize(
    ("raw", "depth"),
    [
        (b"1", 0),
        (b"[]", 1),
        (b'{"a": [1, {"b": "[[[[ {{{{"}]}', 3),  # brackets in strings are text
        (b'{"a": "x\\"[["}', 1),  # so are escaped quotes
        (b'{"a": "x\\\\"}', 1),  # an escaped backslash ends before the quote
        (b"[[]][[[]]]", 3),
        (_nested(32), 32),
    ],
)
def test_nesting_is_measured_outside_strings(raw: bytes, depth: int) -> None:
    assert closes_within(raw, depth)
    assert depth == 0 or not closes_within(raw, depth - 1)


@pytest.mark.parametrize("raw", [b"[[[", b'{"a": [1}', b'{"a": "unterminated [[[', b"]]][[["])
def test_brackets_that_never_close_are_refused_before_parsing(raw: bytes) -> None:
    assert not closes_within(raw, 64)


def test_depth_limit_holds_where_the_parser_would_recurse() -> None:
    assert parse_json(_nested(32), max_depth=32) == {"a": json.loads(_nested(32))["a"]}
    for depth in (33, 5_000, 1_000_000):  # the last is far past the interpreter's stack
        with pytest.raises(JsonBodyError, match="more than 32 levels"):
            parse_json(_nested(depth), max_depth=32)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"a": NaN}', "NaN is not a JSON number"),
        (b'{"a": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"a": 1e999}', "too large for a float"),
        (b'{"a": ' + b"9" * 5000 + b"}", "not JSON this server reads"),
        (b"\xef\xbb\xbf{}", "not JSON"),
        ('{"a": 1}'.encode("utf-16"), "not UTF-8"),
        (b'{"a": tru}', "not JSON"),
    ],
)
def test_what_is_not_plain_json_is_a_400_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(JsonBodyError, match=reason):
        parse_json(raw, max_depth=32)


# ------------------------------------------------------------- parser refusals, classified


def test_the_parser_s_refusals_are_414_431_or_400() -> None:
    limits = HttpLimits()
    line = LineTooLong(b"/aaa...", limits.max_request_line_bytes)
    field = LineTooLong(b"vvv...", limits.max_header_field_bytes)
    assert malformed_status(line, limits) == 414
    assert malformed_status(field, limits) == 431
    assert malformed_status(BadHttpMessage("Too many headers received"), limits) == 431
    assert malformed_status(BadHttpMessage("Invalid method"), limits) == 400
    with pytest.raises(ValueError, match="must differ"):
        HttpLimits(max_request_line_bytes=8190, max_header_field_bytes=8190)


# --------------------------------------------------------------- idempotency and tracing


def _request(**headers: str) -> Any:
    return make_mocked_request("POST", "/v1/completions", headers=headers)


def test_the_idempotency_key_is_explicit() -> None:
    assert idempotency_key(_request(), None) is None
    assert idempotency_key(_request(**{"X-Request-Id": "trace-1"}), None) is None
    assert idempotency_key(_request(), "from-body") == "from-body"
    assert idempotency_key(_request(**{"Idempotency-Key": "k-1"}), None) == "k-1"
    # The draft's structured-field string is quoted; the quotes are not the key.
    assert idempotency_key(_request(**{"Idempotency-Key": '"k-1"'}), None) == "k-1"
    assert idempotency_key(_request(**{"Idempotency-Key": "k-1"}), "k-1") == "k-1"
    for bad, body_id in (("has space", None), ("", None), ("x" * 257, None), ("k-1", "k-2")):
        with pytest.raises(ApiError) as refused:
            idempotency_key(_request(**{"Idempotency-Key": bad}), body_id)
        assert (refused.value.status, refused.value.param) == (400, "Idempotency-Key")


def test_only_a_tidy_x_request_id_is_echoed() -> None:
    assert client_trace_id(_request(**{"X-Request-Id": "4bf92f35-0a1b"})) == "4bf92f35-0a1b"
    for untidy in ("a b", "é", "x" * 257, ""):
        assert client_trace_id(_request(**{"X-Request-Id": untidy})) is None
    assert client_trace_id(_request()) is None


class _Bridge:
    """What ``Gateway._send`` hands to Kafka, recorded; no answer ever comes (a 504)."""

    def __init__(self) -> None:
        self.sent: list[tuple[InferenceRequest, str | None]] = []

    async def send(
        self, topic: str, request: InferenceRequest, *, look_up_in: str | None, headers: Any = None
    ) -> None:
        self.sent.append((request, look_up_in))

    async def abort(self, request_id: str) -> None:
        return None


@pytest.fixture
async def wired() -> Any:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = GatewaySettings(
        kafka=KafkaConnection(bootstrap_servers="127.0.0.1:1"),
        models=[ModelRoute(name="m")],
        keys=[KEY],
        request_timeout_s=0.2,
    )
    gateway = Gateway(settings, tracer=provider.get_tracer("test"))
    bridge = _Bridge()
    gateway.bridge.send = bridge.send  # type: ignore[method-assign]
    gateway.bridge.abort = bridge.abort  # type: ignore[method-assign]
    gateway.bridge.ready.set()
    async with TestClient(TestServer(gateway.app(), host="127.0.0.1")) as http:
        yield http, bridge, exporter


async def test_x_request_id_neither_joins_nor_repeats_requests(wired: Any) -> None:
    """Two requests under one X-Request-Id are two Kafka requests (each with an id of its own
    and no look-up), the header is echoed, and it is on each producer span."""
    http, bridge, exporter = wired
    for prompt in ("first", "second"):
        body = {"model": "m", "prompt": prompt}
        response = await http.post(
            "/v1/completions", json=body, headers=AUTH | {"X-Request-Id": "same-trace"}
        )
        assert response.status == 504  # nobody answers here
        assert response.headers["X-Request-Id"] == "same-trace"
    (first, look_1), (second, look_2) = bridge.sent
    assert (first.prompt, second.prompt) == ("first", "second")
    assert first.request_id != second.request_id
    assert first.request_id.startswith("gw-") and (look_1, look_2) == (None, None)
    spans = exporter.get_finished_spans()
    assert [s.attributes[attr.HTTP_REQUEST_HEADER_X_REQUEST_ID] for s in spans] == [
        ("same-trace",),
        ("same-trace",),
    ]


async def test_an_idempotency_key_is_the_request_id_and_is_looked_up(wired: Any) -> None:
    http, bridge, _ = wired
    body = {"model": "m", "prompt": "hi"}
    response = await http.post(
        "/v1/completions", json=body, headers=AUTH | {"Idempotency-Key": '"order-7"'}
    )
    assert response.status == 504
    [(sent, look_up)] = bridge.sent
    # The key scoped to the API key's tenant ("<key>@<16 hex of the tenant's SHA-256>").
    assert re.fullmatch(r"order-7@[0-9a-f]{16}", sent.request_id)
    assert response.headers["X-Request-Id"] == sent.request_id  # no X-Request-Id: the record's
    assert look_up == "kvgate.results"  # a retry elsewhere finds the first answer


def test_idempotency_keys_are_scoped_to_their_tenant() -> None:
    digest = hashlib.sha256(b"acme").hexdigest()[:16]
    assert scoped_request_id("order-7", "acme") == f"order-7@{digest}"
    assert scoped_request_id("order-7", "acme") != scoped_request_id("order-7", "acme2")
    longest = "k" * 256  # a valid key, too long to keep beside its scope
    scoped = scoped_request_id(longest, "acme")
    assert scoped == f"{hashlib.sha256(longest.encode()).hexdigest()}@{digest}"
    assert re.fullmatch(REQUEST_ID_PATTERN, scoped)
    assert scoped != scoped_request_id("k" * 255, "acme")


async def test_refusals_are_openai_error_objects(wired: Any) -> None:
    http, bridge, _ = wired
    cases = [
        (http.get("/nope", headers=AUTH), 404, "not_found"),
        (http.put("/v1/completions", headers=AUTH), 405, "method_not_allowed"),
        (
            http.post("/v1/completions", data=b"x", headers=AUTH | {"Content-Type": "text/plain"}),
            415,
            "unsupported_media_type",
        ),
        (
            http.post("/v1/completions", data=b"[" * 40 + b"]" * 40, headers=AUTH | JSON),
            400,
            "invalid_json",
        ),
        (
            http.post("/v1/completions", json={"model": "m", "prompt": [-1]}, headers=AUTH),
            400,
            "invalid_value",
        ),
        (
            http.post("/v1/completions", data=b" " * (2**20 + 1), headers=AUTH | JSON),
            413,
            "request_too_large",
        ),
    ]
    for call, status, code in cases:
        response = await call
        error = (await response.json())["error"]
        assert (response.status, error["code"]) == (status, code), error
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert bridge.sent == []


# ---------------------------------------------------------------- rate limits per replica


def test_replicas_share_a_key_s_rate_and_never_exceed_it_together() -> None:
    """Three replicas, each enforcing a third, under a client far over the limit spread over
    them: together they allow the configured rate (plus its burst), not three times it."""
    key = ApiKey(name="k", key="sk-rate-0123456789abcdef", requests_per_s=30, burst=30)
    now = [0.0]
    replicas = [RateLimiter(lambda: now[0], replicas=3) for _ in range(3)]
    assert replicas[0].share(key) == (10.0, 10.0)
    allowed = 0
    for step in range(10_000):  # 10 s at 1000 requests per second
        now[0] = step / 1000
        allowed += replicas[step % 3].take(key) is None
    assert 300 <= allowed <= 300 + 30  # 30 per second for 10 s, and the burst once
    lone = RateLimiter(lambda: now[0])
    assert lone.share(key) == (30.0, 30.0)
    said = replicas[0].describe([key, ApiKey(name="free", key="sk-free-0123456789abcdef")])
    assert said is not None and "allows 1/3" in said and "k 10/s burst 10" in said
    assert "free" not in said and lone.describe([]) is None


def test_a_replica_s_burst_is_never_below_one_request() -> None:
    key = ApiKey(name="k", key="sk-rate-0123456789abcdef", requests_per_s=0.5, burst=1)
    assert RateLimiter(replicas=4).share(key) == (0.125, 1.0)
    assert RateLimiter(replicas=4).take(key) is None  # a first request passes
