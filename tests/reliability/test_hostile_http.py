"""Hostile HTTP at real processes: ``kvgate gateway`` (its OpenAI port and its health port),
``kvgate admission-service`` (its admin API) and ``kvgate sim-executor`` (its step server), over
the embedded broker (no Docker).

For every server, generated hostile requests (``tests/reliability/http_fuzz.py``: hypothesis,
derandomized and bounded so the run is the same every time) are sent over raw sockets, and
each must be answered with a status below 500 (in the server's error shape: an OpenAI error
object on the gateway, ``AdminError`` on the admin API) or closed, within
``EXCHANGE_DEADLINE_S``; after each one a normal request must be answered 200 within
``PROMPT_S``. Stalled, dripping and vanishing clients are sent together and must be closed or
answered within the head and body timeouts. At the end the server's resident memory may have
grown by at most ``RSS_GROWTH_BOUND`` and its log must hold no traceback. A table of malformed
requests checks each one's exact status. ``slow``: the same fuzz with 10 times the examples.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings

from kvgate.local.embedded_broker import EmbeddedBroker
from tests.admission_service.kafka_helpers import Topics
from tests.integration.admission_stack import (
    ADMIN_TOKEN,
    EXECUTOR_TOKEN,
    GATEWAY_KEY,
    Process,
    service_settings,
    start_gateway,
    start_service,
    start_sim_executor,
)
from tests.reliability.http_fuzz import (
    Delivery,
    Hostile,
    Outcome,
    Profile,
    exchange,
    head,
    hostile_requests,
    outcome_of,
    request,
)

pytestmark = pytest.mark.timeout(600)

HEAD_TIMEOUT_S = 1.0  # the gateway's and the admin API's (the step server keeps its 10 s)
BODY_TIMEOUT_S = 2.0
STEP_HEAD_TIMEOUT_S = 10.0  # kvgate.web.guard.HttpLimits' default
LINGER_S = 2.0
EXCHANGE_DEADLINE_S = BODY_TIMEOUT_S + LINGER_S + 4.0
PROMPT_S = 2.0
RSS_GROWTH_BOUND = 64 * 2**20  # bytes; bodies are at most 1 MiB, and none may be kept
EXAMPLES = 300  # per server; the slow run takes 10 times as many

COMPLETION = {"model": "sim", "prompt": [1, 2, 3, 4], "max_tokens": 3, "ignore_eos": True}
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _json_of(outcome: Outcome) -> Any:
    try:
        return outcome.json()
    except ValueError:
        return None


def _openai_error(outcome: Outcome) -> bool:
    body = _json_of(outcome)
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}


def _admin_error(outcome: Outcome) -> bool:
    body = _json_of(outcome)
    return isinstance(body, dict) and isinstance(body.get("error"), str) and "detail" in body


def _text_or_json(outcome: Outcome) -> bool:
    return bool(outcome.body.strip())


@dataclass
class Target:
    profile: Profile
    process: Process
    error_shape: Callable[[Outcome], bool]

    @property
    def pid(self) -> int:
        return self.process.popen.pid

    def rss_bytes(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)


@dataclass
class Servers:
    gateway: Target
    health: Target
    admin: Target
    step: Target
    executor_endpoint: str

    def all(self) -> list[Target]:
        return [self.gateway, self.health, self.admin, self.step]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    logs = tmp_path_factory.mktemp("hostile-http")
    topics = Topics.unique("hostile")
    with EmbeddedBroker() as broker:
        executor = start_sim_executor(logs, "exec-a", num_blocks=128, block_size=4)
        tansu = {
            "partitions": 1,
            "exactly_once": "off",
            "session_timeout_ms": 2000,
            "heartbeat_interval_ms": 500,
        }
        config = service_settings(broker.bootstrap, topics, [executor], kafka=tansu)
        config["admin"] |= {"head_timeout_s": HEAD_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S}
        service = start_service(logs, "service", config)
        timeouts = (
            "--head-timeout-s",
            str(HEAD_TIMEOUT_S),
            "--body-timeout-s",
            str(BODY_TIMEOUT_S),
            "--request-timeout-s",
            "30",
        )
        gateway = start_gateway(logs, broker.bootstrap, topics, "hostile", extra=timeouts)
        members = [{"name": "exec-a", "endpoint": executor.endpoint}]
        try:
            yield Servers(
                gateway=Target(_gateway_profile(gateway.port), gateway.process, _openai_error),
                health=Target(_health_profile(gateway.health_port), gateway.process, _openai_error),
                admin=Target(
                    _admin_profile(service.admin_port, members), service.process, _admin_error
                ),
                step=Target(_step_profile(executor.port), executor.process, _text_or_json),
                executor_endpoint=executor.endpoint,
            )
        finally:
            for process in (gateway.process, service.process, executor.process):
                process.stop()


def _gateway_profile(port: int) -> Profile:
    auth = f"Bearer {GATEWAY_KEY}"
    return Profile(
        name="gateway",
        port=port,
        authorization=auth,
        json_routes=(("POST", "/v1/completions"), ("POST", "/v1/chat/completions")),
        paths=(
            "/v1/models",
            "/v1/completions",
            "/v1/chat/completions",
            "/healthz",
            "/readyz",
            "/metrics",
        ),
        normal=request("GET", "/v1/models", authorization=auth).head,
        json_bodies=(COMPLETION, CHAT),
    )


def _health_profile(port: int) -> Profile:
    return Profile(
        name="gateway health",
        port=port,
        authorization="Bearer none",
        json_routes=(("POST", "/healthz"),),
        paths=("/healthz", "/readyz", "/metrics"),
        normal=request("GET", "/healthz").head,
    )


def _admin_profile(port: int, members: list[dict[str, str]]) -> Profile:
    auth = f"Bearer {ADMIN_TOKEN}"
    # The one valid body is the membership the service has: a hostile copy that parses must
    # not take the executor away (drains are not generated either).
    return Profile(
        name="admin API",
        port=port,
        authorization=auth,
        json_routes=(("PUT", "/v1/executors"),),
        paths=(
            "/v1/executors",
            "/v1/executors/exec-a",
            "/v1/executors/nobody/drain",
            "/healthz",
            "/readyz",
            "/metrics",
        ),
        normal=request("GET", "/v1/executors").head,
        json_bodies=({"executors": members},),
    )


def _step_profile(port: int) -> Profile:
    auth = f"Bearer {EXECUTOR_TOKEN}"
    # A valid import names a ticket nobody exported on this executor itself: a 4xx, whatever
    # the backend (it fetches nothing, or it is told "not found").
    ticket = {"source": f"http://127.0.0.1:{port}", "ticket": "t" * 20, "request_id": "r-1"}
    return Profile(
        name="step server",
        port=port,
        authorization=auth,
        json_routes=(("POST", "/v1/snapshots/import"),),
        paths=(
            "/healthz",
            "/readyz",
            "/metrics",
            "/v1/tokenizer",
            "/v1/steps",
            "/v1/snapshots/" + "t" * 20,
            "/v1/snapshots/import",
        ),
        normal=request("GET", "/healthz").head,
        json_bodies=(ticket,),
    )


# ------------------------------------------------------------------------ the checks


def _normal(target: Target) -> Outcome:
    return outcome_of(
        target.profile.port, Hostile("normal", target.profile.normal), deadline_s=PROMPT_S
    )


def check_survives(target: Target, hostile: Hostile) -> None:
    """``hostile`` gets a status below 500 in the server's error shape (or the connection
    closes) in time, and a normal request is answered 200 promptly after it."""
    outcome = outcome_of(target.profile.port, hostile, deadline_s=EXCHANGE_DEADLINE_S)
    assert not outcome.timed_out, f"{target.profile.name}: no answer in time to {hostile!r}"
    if outcome.status is not None:
        assert outcome.status < 500, (
            f"{target.profile.name}: {outcome.status} {outcome.body[:300]!r} for {hostile!r}"
        )
        if outcome.status >= 400 and not hostile.head.startswith(b"HEAD "):
            assert target.error_shape(outcome), f"{target.profile.name}: {outcome.body[:300]!r}"
    elif hostile.delivery in (Delivery.WHOLE, Delivery.SPLIT):
        pytest.fail(f"{target.profile.name}: closed without an answer to {hostile!r}")
    normal = _normal(target)
    assert normal.status == 200, f"{target.profile.name} after {hostile!r}: {normal}"


def check_clean_end(target: Target, rss_before: int) -> None:
    grown = target.rss_bytes() - rss_before
    assert grown <= RSS_GROWTH_BOUND, f"{target.profile.name}: RSS grew by {grown / 2**20:.0f} MiB"
    log = target.process.log_path.read_text(errors="replace")
    where = log.find("Traceback")
    assert where < 0, f"{target.profile.name}'s log: {log[max(0, where - 300) : where + 3000]}"


def _fuzz(target: Target, examples: int) -> None:
    for _ in range(5):  # warm: first requests allocate what every later one reuses
        assert _normal(target).status == 200
    rss_before = target.rss_bytes()

    @settings(
        derandomize=True,
        database=None,
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(hostile=hostile_requests(target.profile))
    def survives(hostile: Hostile) -> None:
        check_survives(target, hostile)

    survives()
    check_clean_end(target, rss_before)


def _complete(servers: Servers) -> None:
    """A real completion through Kafka and the executor, after the hostile traffic."""
    body = json.dumps(COMPLETION).encode()
    asked = request(
        "POST",
        "/v1/completions",
        authorization=servers.gateway.profile.authorization,
        headers={"Content-Type": "application/json"},
        body=body,
    )
    outcome = outcome_of(servers.gateway.profile.port, asked, deadline_s=30)
    assert outcome.status == 200, outcome
    assert outcome.json()["usage"]["completion_tokens"] == COMPLETION["max_tokens"]


@pytest.mark.parametrize("name", ["gateway", "health", "admin", "step"])
def test_generated_hostile_requests_never_get_a_5xx(servers: Servers, name: str) -> None:
    _fuzz(getattr(servers, name), EXAMPLES)
    _complete(servers)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gateway", "health", "admin", "step"])
def test_many_generated_hostile_requests_never_get_a_5xx(servers: Servers, name: str) -> None:
    _fuzz(getattr(servers, name), 10 * EXAMPLES)
    _complete(servers)


# ------------------------------------------------------------- slow and vanishing clients


def _json_request(profile: Profile, body: bytes, *, cut: float, delivery: Delivery) -> Hostile:
    method, path = profile.json_routes[0]
    headers = [
        (b"Host", b"127.0.0.1"),
        (b"Authorization", profile.authorization.encode()),
        (b"Content-Type", b"application/json"),
        (b"Content-Length", str(len(body)).encode()),
    ]
    whole = head(method.encode(), path.encode(), headers)
    # cut: the share of the whole request sent, chosen to fall inside the body
    share = (len(whole) + cut * len(body)) / (len(whole) + len(body))
    return Hostile(f"{delivery.value} body", whole, body, delivery, cut=share)


def _stragglers(target: Target, head_timeout_s: float) -> list[tuple[Hostile, float, int | None]]:
    """(client, deadline, the status it must get; None: it may only be closed)."""
    profile = target.profile
    normal = Hostile("normal", profile.normal)
    body = json.dumps(profile.json_bodies[0] if profile.json_bodies else {}).encode()
    closed_by = head_timeout_s + 4.0
    clients: list[tuple[Hostile, float, int | None]] = [
        (
            Hostile("stalled request line", normal.head, delivery=Delivery.STALL, cut=0.2),
            closed_by,
            None,
        ),
        (
            Hostile("stalled headers", normal.head[:-2], delivery=Delivery.STALL, cut=1.0),
            closed_by,
            None,
        ),
        (Hostile("dripping headers", normal.head, delivery=Delivery.DRIP), closed_by, None),
        (_json_request(profile, body, cut=0.6, delivery=Delivery.BREAK_OFF), closed_by, None),
    ]
    if head_timeout_s == HEAD_TIMEOUT_S and profile.json_bodies:  # the step server's is 30 s
        stalled = _json_request(profile, body, cut=0.5, delivery=Delivery.STALL)
        clients.append((stalled, BODY_TIMEOUT_S + 4.0, 408))
    return clients


async def _stream_and_vanish(port: int, authorization: str) -> bytes:
    """A streamed completion whose client leaves after its first event."""
    body = json.dumps(COMPLETION | {"stream": True, "max_tokens": 500}).encode()
    asked = request(
        "POST",
        "/v1/completions",
        authorization=authorization,
        headers={"Content-Type": "application/json"},
        body=body,
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(asked.head + asked.body)
    async with asyncio.timeout(30):
        first = await reader.readuntil(b"data: ")
    writer.transport.abort()
    return first


@pytest.mark.parametrize("name", ["gateway", "admin", "step"])
def test_stalled_dripping_and_vanishing_clients_end_in_time(servers: Servers, name: str) -> None:
    target: Target = getattr(servers, name)
    head_timeout_s = STEP_HEAD_TIMEOUT_S if name == "step" else HEAD_TIMEOUT_S
    clients = _stragglers(target, head_timeout_s)

    async def all_at_once() -> list[Outcome]:
        outcomes = asyncio.gather(
            *(exchange(target.profile.port, c, deadline_s=d) for c, d, _ in clients)
        )
        if name == "gateway":
            first = await _stream_and_vanish(target.profile.port, target.profile.authorization)
            assert b" 200 " in first.split(b"\r\n", 1)[0], first
        return list(await outcomes)

    began = time.monotonic()
    outcomes = asyncio.run(all_at_once())
    for (client, deadline_s, status), outcome in zip(clients, outcomes, strict=True):
        assert not outcome.timed_out, f"{client.label}: still open after {deadline_s:g} s"
        assert outcome.status == status, f"{client.label}: {outcome}"
    assert time.monotonic() - began < max(d for _, d, _ in clients) + 5.0
    assert _normal(target).status == 200
    check_clean_end(target, rss_before=target.rss_bytes())


# ------------------------------------------------------------------ each kind, its status


def _raw(
    label: str, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes = b""
) -> Hostile:
    fields = [(b"Host", b"127.0.0.1"), (b"Connection", b"close"), *headers]
    if body and not any(name == b"Transfer-Encoding" for name, _ in fields):
        fields.append((b"Content-Length", str(len(body)).encode()))
    return Hostile(label, head(method, path, fields), body)


def _nested(depth: int) -> bytes:
    """A completion body whose prompt nests lists so that the body is ``depth`` deep."""
    lists = depth - 1  # the object is the first level
    return b'{"model": "sim", "prompt": ' + b"[" * lists + b"1" + b"]" * lists + b"}"


def _chunked(body: bytes) -> bytes:
    size = 65536
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def _common_cases(profile: Profile) -> list[tuple[Hostile, int, Any]]:
    path = profile.paths[0].encode()
    auth = (b"Authorization", profile.authorization.encode())
    return [
        (_raw("unknown path", b"GET", b"/no/such/path", [auth]), 404, None),
        (_raw("request line over the limit", b"GET", b"/" + b"a" * 5000, [auth]), 414, None),
        (_raw("header over the limit", b"GET", path, [auth, (b"X-Big", b"b" * 9000)]), 431, None),
        (
            _raw(
                "too many headers", b"GET", path, [auth] + [(b"X-%d" % i, b"1") for i in range(101)]
            ),
            431,
            None,
        ),
        (
            Hostile("not HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\r\n\r\n"),
            400,
            None,
        ),
        (_raw("unmet Expect", b"GET", path, [auth, (b"Expect", b"teapot")]), 417, None),
    ]


def _gateway_cases(profile: Profile) -> list[tuple[Hostile, int, Any]]:
    auth = (b"Authorization", profile.authorization.encode())
    json_type = (b"Content-Type", b"application/json")
    ok = json.dumps(COMPLETION).encode()
    post = b"/v1/completions"

    def body(label: str, data: bytes, *extra: tuple[bytes, bytes]) -> Hostile:
        return _raw(label, b"POST", post, [auth, json_type, *extra], data)

    big = b'{"model": "sim", "prompt": "' + b"a" * (3 * 2**19) + b'"}'
    return [
        (_raw("method", b"PUT", post, [auth, json_type], ok), 405, "method_not_allowed"),
        (_raw("no key", b"POST", post, [json_type], ok), 401, "invalid_api_key"),
        (
            _raw(
                "key not UTF-8",
                b"POST",
                post,
                [(b"Authorization", b"Bearer \xff\xfe"), json_type],
                ok,
            ),
            401,
            "invalid_api_key",
        ),
        (
            _raw("text/plain", b"POST", post, [auth, (b"Content-Type", b"text/plain")], ok),
            415,
            "unsupported_media_type",
        ),
        (
            _raw(
                "UTF-16 charset",
                b"POST",
                post,
                [auth, (b"Content-Type", b"application/json; charset=utf-16")],
                ok,
            ),
            415,
            "unsupported_media_type",
        ),
        (
            body("gzip", gzip.compress(ok), (b"Content-Encoding", b"gzip")),
            415,
            "unsupported_media_type",
        ),
        (body("1.5 MiB", big), 413, "request_too_large"),
        (
            _raw(
                "1.5 MiB chunked",
                b"POST",
                post,
                [auth, json_type, (b"Transfer-Encoding", b"chunked")],
                _chunked(big),
            ),
            413,
            "request_too_large",
        ),
        (body("nested 100000 deep", _nested(100_000)), 400, "invalid_json"),
        (body("nested 33 deep", _nested(33)), 400, "invalid_json"),
        (body("nested 32 deep: read, then refused by field", _nested(32)), 400, "invalid_value"),
        (body("NaN", ok.replace(b"3,", b"NaN,", 1)), 400, "invalid_json"),
        (body("1e999", ok.replace(b"3,", b"1e999,", 1)), 400, "invalid_json"),
        (body("UTF-16 body", json.dumps(COMPLETION).encode("utf-16")), 400, "invalid_json"),
        (body("not JSON", b"{not json"), 400, "invalid_json"),
        (
            body("token id below 0", json.dumps(COMPLETION | {"prompt": [-1]}).encode()),
            400,
            "invalid_value",
        ),
        (
            body("idempotency key with a space", ok, (b"Idempotency-Key", b"has space")),
            400,
            "invalid_value",
        ),
    ]


def _admin_cases(profile: Profile) -> list[tuple[Hostile, int, Any]]:
    auth = (b"Authorization", profile.authorization.encode())
    members = json.dumps(profile.json_bodies[0]).encode()
    return [
        (_raw("method", b"DELETE", b"/v1/executors", [auth]), 405, None),
        (
            _raw(
                "token not UTF-8",
                b"PUT",
                b"/v1/executors",
                [(b"Authorization", b"Bearer \xff\xfe")],
                members,
            ),
            401,
            None,
        ),
        (_raw("2 MiB", b"PUT", b"/v1/executors", [auth], b" " * 2**21), 413, None),
        (
            _raw(
                "nested 100000 deep",
                b"PUT",
                b"/v1/executors",
                [auth],
                b'{"executors": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            ),
            422,
            None,
        ),
        (
            _raw(
                "gzip",
                b"PUT",
                b"/v1/executors",
                [auth, (b"Content-Encoding", b"gzip")],
                gzip.compress(members),
            ),
            415,
            None,
        ),
    ]


def _step_cases(profile: Profile) -> list[tuple[Hostile, int, Any]]:
    auth = (b"Authorization", profile.authorization.encode())
    path = b"/v1/snapshots/import"
    asked = dict(profile.json_bodies[0])
    return [
        (_raw("method", b"POST", b"/healthz", []), 405, None),
        (
            _raw(
                "token not UTF-8",
                b"GET",
                b"/v1/tokenizer",
                [(b"Authorization", b"Bearer \xff\xfe")],
            ),
            401,
            None,
        ),
        (
            _raw(
                "source not a URL",
                b"POST",
                path,
                [auth],
                json.dumps(asked | {"source": "http://[::"}).encode(),
            ),
            400,
            None,
        ),
        (
            _raw(
                "nested 100000 deep",
                b"POST",
                path,
                [auth],
                b'{"source": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            ),
            400,
            None,
        ),
        (_raw("2 MiB", b"POST", path, [auth], b" " * 2**21), 413, None),
    ]


@pytest.mark.parametrize("name", ["gateway", "admin", "step"])
def test_each_malformed_request_gets_its_4xx(servers: Servers, name: str) -> None:
    target: Target = getattr(servers, name)
    specific = {"gateway": _gateway_cases, "admin": _admin_cases, "step": _step_cases}[name]
    cases = [*_common_cases(target.profile), *specific(target.profile)]
    wrong: list[str] = []
    for hostile, status, code in cases:
        outcome = outcome_of(target.profile.port, hostile, deadline_s=EXCHANGE_DEADLINE_S)
        if outcome.status != status or not target.error_shape(outcome):
            wrong.append(f"{hostile.label}: {outcome.status} {outcome.body[:200]!r}")
        elif code is not None and outcome.json()["error"]["code"] != code:
            wrong.append(f"{hostile.label}: code {outcome.json()['error']['code']}, not {code}")
        if name == "gateway" and status == 405 and outcome.headers.get("allow") != "POST":
            wrong.append(f"{hostile.label}: Allow {outcome.headers.get('allow')!r}")
    assert not wrong, "\n".join(wrong)
    assert _normal(target).status == 200
    check_clean_end(target, rss_before=target.rss_bytes())
