"""Hostile HTTP requests as raw bytes, a raw-socket client that sends them (whole, in pieces,
half-closed, or breaking off mid-body) and reads what comes back within a deadline.

The kinds cover what a client on the internet sends a server: bytes that are not HTTP, odd
request lines, request lines and headers around and far over the limits, too many headers,
forbidden bytes in headers, conflicting lengths, every shape of ``Authorization``, unknown
paths and methods, and JSON bodies that are not what a route reads — the hostile Kafka
records of ``tests/reliability/fuzz.py`` (truncated, garbage, deep nesting, bad encodings, huge
prompts, wrong types) sent as HTTP bodies, deeper nesting still, random JSON, non-UTF-8 and
compressed bodies, and bodies around and over the size limit under every ``Content-Type``.

:func:`hostile_requests` is a hypothesis strategy over those; :func:`exchange` sends one on a
fresh connection. A :class:`Profile` says what one server serves (its JSON routes, its valid
credential, the request that must keep working).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import random
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hypothesis import strategies as st

from tests.reliability.fuzz import BAD_KINDS, BAD_TRACEPARENTS, Limits

_FUZZ_LIMITS = Limits()
_CRLF = b"\r\n"


class Delivery(StrEnum):
    WHOLE = "whole"
    SPLIT = "split"  # in pieces, back to back
    HALF_CLOSE = "half close"  # whole, then the client's FIN
    BREAK_OFF = "break off"  # the head and part of the body, then the connection closes
    STALL = "stall"  # the head (or part of it) and part of the body, then nothing
    DRIP = "drip"  # one byte at a time, 0.2 s apart, for as long as the server listens


@dataclass(frozen=True)
class Hostile:
    label: str
    head: bytes
    body: bytes = b""
    delivery: Delivery = Delivery.WHOLE
    pieces: int = 1  # for SPLIT
    cut: float = 0.5  # for BREAK_OFF and STALL: the share of the bytes sent

    @property
    def answer_expected(self) -> bool:
        """Whether the client waits for an answer (it does not when it broke off)."""
        return self.delivery is not Delivery.BREAK_OFF

    def __repr__(self) -> str:  # hypothesis prints failing examples: keep them readable
        shown = self.head if len(self.head) <= 300 else self.head[:300] + b"..."
        body = f"{len(self.body)} bytes {self.body[:120]!r}"
        return f"Hostile({self.label!r}, head={shown!r}, body={body}, {self.delivery.value})"


@dataclass(frozen=True)
class Outcome:
    status: int | None  # None: no response (closed, reset, or nothing before the deadline)
    headers: dict[str, str]
    body: bytes
    elapsed_s: float
    timed_out: bool  # the deadline passed with the connection still open and no answer

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Profile:
    """What one server serves, for the generators."""

    name: str
    port: int
    json_routes: tuple[tuple[str, str], ...]  # (method, path) taking a JSON body
    paths: tuple[str, ...]  # every path it serves
    authorization: str  # a valid Authorization header value
    normal: bytes  # a request that must keep being answered 200
    json_bodies: tuple[dict[str, Any], ...] = ()  # valid bodies of json_routes (to break)
    max_request_line_bytes: int = 4096
    max_header_field_bytes: int = 8190
    max_headers: int = 100
    max_body_bytes: int = 2**20
    extra_headers: dict[str, str] = field(default_factory=dict)


def head(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], version: bytes = b"HTTP/1.1"
) -> bytes:
    lines = [method + b" " + target + b" " + version]
    lines += [name + b": " + value for name, value in headers]
    return _CRLF.join(lines) + _CRLF + _CRLF


def request(
    method: str,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    authorization: str | None = None,
) -> Hostile:
    """A well-formed request (the table tests' and the normal requests' shape)."""
    fields = [(b"Host", b"127.0.0.1"), (b"Connection", b"close")]
    if authorization is not None:
        fields.append((b"Authorization", authorization.encode()))
    for name, value in (headers or {}).items():
        fields.append((name.encode(), value.encode()))
    if body or method in ("POST", "PUT", "PATCH"):
        fields.append((b"Content-Length", str(len(body)).encode()))
    return Hostile(f"{method} {path}", head(method.encode(), path.encode(), fields), body)


# ------------------------------------------------------------------------------ the client


async def exchange(port: int, hostile: Hostile, *, deadline_s: float) -> Outcome:
    """Send ``hostile`` on a fresh connection to 127.0.0.1:``port`` and read one response
    (its head, then its body by Content-Length, chunks, or to EOF) until ``deadline_s``."""
    began = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sending = asyncio.create_task(_send(writer, hostile))
    try:
        async with asyncio.timeout(deadline_s):
            status, headers, body = await _read_response(
                reader, head_only=hostile.head.startswith(b"HEAD ")
            )
        timed_out = False
    except TimeoutError:
        status, headers, body, timed_out = None, {}, b"", True
    except (ConnectionError, asyncio.IncompleteReadError, ValueError):
        status, headers, body, timed_out = None, {}, b"", False
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
            await sending
        writer.transport.abort()
    if timed_out and not hostile.answer_expected:
        timed_out = False
    return Outcome(status, headers, body, time.monotonic() - began, timed_out)


async def _send(writer: asyncio.StreamWriter, hostile: Hostile) -> None:
    data = hostile.head + hostile.body
    with contextlib.suppress(ConnectionError, OSError):
        if hostile.delivery is Delivery.SPLIT:
            size = max(1, len(data) // max(1, hostile.pieces))
            for start in range(0, len(data), size):
                writer.write(data[start : start + size])
                await writer.drain()
                await asyncio.sleep(0)  # separate segments, as a slow network delivers them
        elif hostile.delivery in (Delivery.BREAK_OFF, Delivery.STALL):
            writer.write(data[: max(1, int(len(data) * hostile.cut))])
            await writer.drain()
            if hostile.delivery is Delivery.BREAK_OFF:
                writer.transport.abort()
                return
            await asyncio.Event().wait()  # a stalled client: nothing more, ever
        elif hostile.delivery is Delivery.DRIP:
            for byte in data:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.2)
        else:
            writer.write(data)
            await writer.drain()
            if hostile.delivery is Delivery.HALF_CLOSE and writer.can_write_eof():
                writer.write_eof()


async def _read_response(
    reader: asyncio.StreamReader, *, head_only: bool
) -> tuple[int | None, dict[str, str], bytes]:
    raw_head = await reader.readuntil(_CRLF + _CRLF)
    while raw_head.startswith(b"HTTP/1.1 1"):  # interim (100 Continue): the answer follows
        raw_head = await reader.readuntil(_CRLF + _CRLF)
    status_line, *header_lines = raw_head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in header_lines:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if head_only:
        return status, headers, b""
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(_CRLF)).split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return status, headers, body
            body += chunk[:-2]
    return status, headers, await reader.read()


def outcome_of(port: int, hostile: Hostile, *, deadline_s: float) -> Outcome:
    return asyncio.run(exchange(port, hostile, deadline_s=deadline_s))


# ------------------------------------------------------------------------------ the kinds

_METHODS = [
    b"GET",
    b"POST",
    b"PUT",
    b"DELETE",
    b"PATCH",
    b"OPTIONS",
    b"HEAD",
    b"TRACE",
    b"CONNECT",
    b"BREW",
    b"get",
    b"P\x00ST",
    b"G ET",
    b"\x16\x03\x01",
]
_VERSIONS = [
    b"HTTP/1.1",
    b"HTTP/1.0",
    b"HTTP/2.0",
    b"HTTP/9.9",
    b"HTTP/1",
    b"http/1.1",
    b"",
    b"HTTP/1.1 extra",
]
_TARGETS = [
    b"*",
    b"/",
    b"//",
    b"/%00",
    b"/%zz",
    b"/../../etc/passwd",
    b"http://example.com/v1/models",
    b"/v1/models?x=" + b"%" * 50,
    b"/\xff\xfe",
    "/ü".encode(),
    b"/v1/completions#frag",
]
_CONTENT_TYPES = [  # JSON half the time: the other half never reaches a parser
    *["application/json"] * 9,
    "application/json; charset=utf-8",
    "application/json; charset=utf-16",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/vnd.api+json",
    "",
    "application/json;;;",
    "\u00e9/json",
]
_AUTHORIZATIONS: list[bytes] = [
    b"",
    b"Bearer",
    b"Bearer ",
    b"bearer x",
    b"Basic Zm9vOmJhcg==",
    b"Bearer " + b"k" * 7000,
    b"Bearer \xff\xfe\xfd",
    b"Bearer \xc3\x28",
    b"Token abc",
    b"Bearer  ",
    b"Bearer a b c",
]


def _base_headers(profile: Profile, *, auth: bool = True) -> list[tuple[bytes, bytes]]:
    headers = [(b"Host", b"127.0.0.1")]
    if auth:
        headers.append((b"Authorization", profile.authorization.encode()))
    return headers


def _with_length(headers: list[tuple[bytes, bytes]], body: bytes) -> list[tuple[bytes, bytes]]:
    return [*headers, (b"Content-Length", str(len(body)).encode())]


def _garbage(draw: st.DrawFn, profile: Profile) -> Hostile:
    data = draw(st.binary(min_size=1, max_size=600))
    return Hostile("garbage", data + _CRLF + _CRLF)


def _request_line(draw: st.DrawFn, profile: Profile) -> Hostile:
    method = draw(st.sampled_from(_METHODS))
    target = draw(
        st.sampled_from([p.encode() for p in profile.paths] + _TARGETS)
        | st.text(max_size=60).map(lambda t: ("/" + t).encode())
    )
    version = draw(st.sampled_from(_VERSIONS))
    return Hostile("request line", head(method, target, _base_headers(profile), version))


def _long_line(draw: st.DrawFn, profile: Profile) -> Hostile:
    limit = profile.max_request_line_bytes
    size = draw(
        st.sampled_from([limit - 64, limit - 15, limit + 1, limit + 64, 10 * limit, 200_000])
    )
    target = b"/" + b"a" * max(1, size - len(b"GET  HTTP/1.1") - 1)
    return Hostile(f"request line of {size} bytes", head(b"GET", target, _base_headers(profile)))


def _long_header(draw: st.DrawFn, profile: Profile) -> Hostile:
    limit = profile.max_header_field_bytes
    size = draw(st.sampled_from([limit - 100, limit + 1, limit + 100, 5 * limit, 300_000]))
    name = draw(
        st.sampled_from(
            [
                b"X-Long",
                b"Cookie",
                b"Authorization",
                b"X-Request-Id",
                b"Idempotency-Key",
                b"traceparent",
                b"X" * 20,
            ]
        )
    )
    value = b"v" * max(1, size - len(name) - 2)
    return Hostile(
        f"{name.decode()} of {size} bytes",
        head(b"GET", profile.paths[0].encode(), [*_base_headers(profile), (name, value)]),
    )


def _many_headers(draw: st.DrawFn, profile: Profile) -> Hostile:
    count = draw(
        st.sampled_from([profile.max_headers - 2, profile.max_headers + 1, 5 * profile.max_headers])
    )
    headers = _base_headers(profile) + [(b"X-%d" % i, b"1") for i in range(count)]
    return Hostile(f"{count} headers", head(b"GET", profile.paths[0].encode(), headers))


def _bad_header(draw: st.DrawFn, profile: Profile) -> Hostile:
    method, path = draw(st.sampled_from(profile.json_routes))
    body = json.dumps(profile.json_bodies[0] if profile.json_bodies else {}).encode()
    bad: list[tuple[bytes, bytes]] = draw(
        st.sampled_from(
            [
                [(b"X-Nul", b"a\x00b")],
                [(b"X-Del", b"a\x7fb")],
                [(b"X-Latin", b"\xff\xfe\xfd")],
                [(b"Bad Name", b"x")],
                [(b"X-Fold", b"a\r\n  continued")],
                [(b"Content-Length", b"5"), (b"Content-Length", b"7")],
                [(b"Content-Length", b"-1")],
                [(b"Content-Length", b"abc")],
                [(b"Content-Length", b"1" * 40)],
                [(b"Transfer-Encoding", b"chunked"), (b"Content-Length", b"3")],
                [(b"Transfer-Encoding", b"gzip, chunked")],
                [(b"Transfer-Encoding", b"identity")],
                [(b"Expect", b"100-continue")],
                [(b"Expect", b"teapot")],
                [(b"Upgrade", b"websocket"), (b"Connection", b"Upgrade")],
                [(b"Content-Type", b"application/json; charset=\xff")],
                [(b"X-Request-Id", b"\xff" * 10)],
                [(b"X-Request-Id", b"a b c")],
                [(b"Idempotency-Key", b"")],
                [(b"Idempotency-Key", b'"' + b"k" * 300 + b'"')],
                [(b"Idempotency-Key", b"has space")],
                [(b"traceparent", draw(st.sampled_from(BAD_TRACEPARENTS)))],
            ]
        )
    )
    headers = [*_base_headers(profile), *bad]
    if not any(name.lower() in (b"content-length", b"transfer-encoding") for name, _ in bad):
        headers = _with_length(headers, body)
    return Hostile("header " + repr(bad)[:60], head(method.encode(), path.encode(), headers), body)


def _authorization(draw: st.DrawFn, profile: Profile) -> Hostile:
    valid = profile.authorization.encode()
    value = draw(st.sampled_from([*_AUTHORIZATIONS, valid[:-1], valid + b"x"]))
    method, path = draw(
        st.sampled_from(profile.json_routes + tuple(("GET", p) for p in profile.paths))
    )
    body = (
        json.dumps(profile.json_bodies[0]).encode()
        if method != "GET" and profile.json_bodies
        else b""
    )
    headers = [(b"Host", b"127.0.0.1"), (b"Authorization", value)]
    return Hostile(
        f"Authorization {value[:30]!r}",
        head(method.encode(), path.encode(), _with_length(headers, body)),
        body,
    )


def _method(draw: st.DrawFn, profile: Profile) -> Hostile:
    method = draw(
        st.sampled_from(
            [b"GET", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"HEAD", b"TRACE", b"FOO", b"POST"]
        )
    )
    path = draw(
        st.sampled_from(
            (
                *profile.paths,
                "/nope",
                "/v1",
                "/v1/",
                "/V1/MODELS",
                "/metrics/",
                "/v1/executors/x/drain/y",
            )
        )
    )
    return Hostile(
        f"{method.decode()} {path}",
        head(method, path.encode(), _with_length(_base_headers(profile), b"")),
    )


def _json_body(draw: st.DrawFn, profile: Profile) -> Hostile:
    method, path = draw(st.sampled_from(profile.json_routes))
    sources = ["kafka fuzz", "nested", "random json", "wrong field", "encoding", "size"]
    source = draw(st.sampled_from([*sources, "nested", "wrong field", "encoding"]))
    if source == "kafka fuzz":  # tests/reliability/fuzz.py's hostile records, as HTTP bodies
        seed = draw(st.integers(0, 2**16))
        kind = BAD_KINDS[seed % len(BAD_KINDS)]
        body = kind(random.Random(seed), seed, _FUZZ_LIMITS).value or b""
        label = f"record {kind.__name__}"
    elif source == "nested":
        depth = draw(st.sampled_from([33, 129, 5_000, 100_000]))
        nested = draw(st.sampled_from([b"[", b'{"a":'])) * depth
        closing = b"]" * depth if nested.startswith(b"[") else b"}" * depth
        body = b'{"model": "x", "prompt": ' + nested + b"1" + closing + b"}"
        label = f"nested {depth}"
    elif source == "random json":
        value = draw(
            st.recursive(
                st.none()
                | st.booleans()
                | st.integers()
                | st.floats(allow_nan=False)
                | st.text(max_size=20),
                lambda inner: (
                    st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4)
                ),
                max_leaves=20,
            )
        )
        body, label = json.dumps(value).encode(), "random json"
    elif source == "wrong field":
        base = dict(draw(st.sampled_from(profile.json_bodies))) if profile.json_bodies else {}
        name = draw(
            st.sampled_from(
                [
                    *base.keys(),
                    "max_tokens",
                    "prompt",
                    "messages",
                    "temperature",
                    "stream",
                    "seed",
                    "priority",
                    "executors",
                    "unknown_field",
                ]
            )
        )
        base[name] = draw(
            st.sampled_from(
                [
                    None,
                    True,
                    -1,
                    0,
                    2**64,
                    1.5,
                    "",
                    "x" * 1000,
                    [],
                    {},
                    [-1, -2],
                    [[1]],
                    {"a": [1]},
                    [{"role": 5}],
                ]
            )
        )
        body, label = json.dumps(base).encode(), f"{name} = {base[name]!r}"[:60]
    elif source == "encoding":
        text = json.dumps(profile.json_bodies[0] if profile.json_bodies else {"a": 1})
        body = draw(
            st.sampled_from(
                [
                    text.encode("utf-16"),
                    text.encode("utf-32"),
                    b"\xef\xbb\xbf" + text.encode(),
                    text.encode().replace(b"{", b"{\xff", 1),
                    b'{"a": NaN}',
                    b'{"a": Infinity}',
                    b'{"a": 1e999}',
                    b'{"a": ' + b"9" * 5000 + b"}",
                    b"\x00" * 64,
                    gzip.compress(text.encode()),
                ]
            )
        )
        label = "encoding"
    else:
        size = draw(
            st.sampled_from(
                [
                    profile.max_body_bytes - 100,
                    profile.max_body_bytes + 1,
                    3 * profile.max_body_bytes,
                ]
            )
        )
        body = b'{"model": "x", "prompt": "' + b"a" * max(0, size - 28) + b'"}'
        label = f"body of {len(body)} bytes"
    content_type = draw(st.sampled_from(_CONTENT_TYPES))
    headers = _base_headers(profile)
    if content_type:
        headers.append((b"Content-Type", content_type.encode()))
    if draw(st.integers(0, 7)) == 0 and len(body) < 100_000 and source != "size":
        headers.append((b"Content-Encoding", b"gzip"))
        body = gzip.compress(body)
    if draw(st.integers(0, 9)) == 0:  # chunked instead of a length
        chunked = b"".join(
            b"%x\r\n%s\r\n" % (len(body[i : i + 4096]), body[i : i + 4096])
            for i in range(0, len(body), 4096)
        )
        return Hostile(
            label + ", chunked",
            head(method.encode(), path.encode(), [*headers, (b"Transfer-Encoding", b"chunked")]),
            chunked + b"0\r\n\r\n",
        )
    return Hostile(label, head(method.encode(), path.encode(), _with_length(headers, body)), body)


_KINDS = [
    _garbage,
    _request_line,
    _long_line,
    _long_header,
    _many_headers,
    _bad_header,
    _authorization,
    _method,
    _json_body,
    _json_body,
]


@st.composite
def hostile_requests(draw: st.DrawFn, profile: Profile) -> Hostile:
    """One hostile request for ``profile``'s server and how it is delivered (never stalled:
    stalled clients are tested together, since each costs the server's timeout)."""
    hostile = draw(st.sampled_from(_KINDS))(draw, profile)
    delivery = draw(
        st.sampled_from(
            [Delivery.WHOLE] * 4 + [Delivery.SPLIT, Delivery.HALF_CLOSE, Delivery.BREAK_OFF]
        )
    )
    pieces = draw(st.integers(2, 40)) if delivery is Delivery.SPLIT else 1
    cut = draw(st.floats(0.05, 0.95)) if delivery is Delivery.BREAK_OFF else 0.5
    return Hostile(hostile.label, hostile.head, hostile.body, delivery, pieces, cut)
