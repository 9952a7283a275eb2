"""The HTTP side: OpenAI routes over the reply bridge, health and metrics.

One request is a sequence of named phases (``_generate``): authenticate → rate-limit → parse
→ route → idempotency → produce → answer (JSON, or server-sent events from the token stream).
A client that goes away (aiohttp cancels the handler, or a write fails) or a request that
outlives ``request_timeout_s`` is aborted on the pool's abort topic.

Both ports are served by ``kvgate.web.guard``: a malformed request (too long a request line or
header, too many headers, a body too large, too slow, too deep or not JSON, an unknown path or
method) is a 4xx with an OpenAI error object, never a 500 or a dropped connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from typing import Any

from aiohttp import web
from aiokafka.errors import KafkaError
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from kvgate.admission_service.tokenizer import TextCodec, load_tokenizer
from kvgate.gateway.auth import KeyRing, RateLimiter
from kvgate.gateway.batch_service import GatewayBatches
from kvgate.gateway.doors import CHAT, COMPLETIONS, RESPONSES, Body, Door, Streamer
from kvgate.gateway.http_input import (
    REQUEST_ID_HEADER,
    client_trace_id,
    idempotency_key,
    json_body,
    render_refusal,
    scoped_request_id,
)
from kvgate.gateway.metrics import GatewayMetrics, request_labels
from kvgate.gateway.openai_api import ApiError, Mapped, bad_field
from kvgate.gateway.replies import ReplyBridge, Waiter
from kvgate.gateway.responses import result_error
from kvgate.gateway.settings import ApiKey, GatewaySettings, ModelRoute
from kvgate.gateway.tokenize_api import detokenize, tokenize
from kvgate.protocol.records import TRACEPARENT_HEADER, InferenceResult
from kvgate.telemetry import attributes as attr
from kvgate.telemetry.context import traceparent_of
from kvgate.web.guard import GuardedRunner, guarded_app

log = logging.getLogger(__name__)


class Gateway:
    def __init__(self, settings: GatewaySettings, tracer: trace.Tracer | None = None) -> None:
        self.settings = settings
        self._tracer = tracer or trace.get_tracer("kvgate.gateway")
        self.bridge = ReplyBridge(settings)
        self.keys = KeyRing(settings.keys, allow_anonymous=settings.allow_anonymous)
        self.limiter = RateLimiter(replicas=settings.rate_limit_replicas)
        self.metrics = GatewayMetrics()
        self.routes = {m.name: m for m in settings.models}
        self.codecs: dict[str, TextCodec | None] = {
            m.name: load_tokenizer(m.tokenizer_file) if m.tokenizer_file else None
            for m in settings.models
        }
        self.batches = (
            None
            if settings.batches is None
            else GatewayBatches(
                settings, settings.batches, self.codecs, self._authenticate, self._rate_limit
            )
        )
        self._background: set[asyncio.Task[None]] = set()
        self._closing = False
        self._runners: list[web.AppRunner] = []
        self.port: int | None = None
        self.health_port: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def app(self) -> web.Application:
        app = guarded_app(self.settings.http_limits, render_refusal, (self._errors,))
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)  # vLLM's, at the root
        app.router.add_post("/detokenize", self.detokenize)
        if self.batches is not None:
            app.add_routes(self.batches.routes())
        health = [
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.metrics_page),
        ]
        app.add_routes(health)
        return app

    def health_app(self) -> web.Application:
        app = guarded_app(self.settings.http_limits, render_refusal)
        app["open"] = True
        app.add_routes(
            [
                web.get("/healthz", self.healthz),
                web.get("/readyz", self.readyz),
                web.get("/metrics", self.metrics_page),
            ]
        )
        return app

    async def start(self) -> None:
        shares = self.limiter.describe(self.settings.keys)
        if shares is not None:
            log.info("%s", shares)
        await self.bridge.start()
        log.info("connected to Kafka at %s", self.settings.kafka.describe())
        if self.batches is not None:
            await self.batches.start()
        self.port = await self._serve(self.app(), self.settings.port)
        if self.settings.health_port is not None:
            self.health_port = await self._serve(self.health_app(), self.settings.health_port)

    async def _serve(self, app: web.Application, port: int) -> int:
        # handler_cancellation: a client that disconnects cancels its handler (-> abort).
        runner = GuardedRunner(
            app, self.settings.http_limits, render_refusal, handler_cancellation=True,
            access_log=None,
        )  # fmt: skip
        await runner.setup()
        site = web.TCPSite(runner, self.settings.host, port, backlog=self.settings.listen_backlog)
        await site.start()
        self._runners.append(runner)
        server = site._server
        assert server is not None
        return int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def close(self) -> None:
        """Stop taking requests, let running ones finish (aiohttp's shutdown timeout), then
        cancel the rest without aborting them: they stay in Kafka, and a client's retry with
        the same id finds its answer on any replica."""
        self._closing = True
        for runner in self._runners:
            await runner.cleanup()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.batches is not None:
            await self.batches.close()
        await self.bridge.close()

    # ------------------------------------------------------------------ middleware
    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
        except ApiError as exc:
            response = web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        except web.HTTPException:
            raise  # aiohttp's own answers (a redirect); its errors were rendered inside
        except Exception:  # a bug, not the client's doing: an OpenAI error object all the same
            log.exception("%s %s failed", request.method, request.path[:200])
            error = ApiError(500, "internal error", type_="server_error", code="internal_error")
            response = web.json_response(error.body(), status=500)
        trace_id = client_trace_id(request)
        if trace_id is not None and not response.prepared:
            response.headers.setdefault(REQUEST_ID_HEADER, trace_id)
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"  # bounded labels
        self.metrics.requests.labels(endpoint=endpoint, status=str(response.status)).inc()
        return response

    def _authenticate(self, request: web.Request) -> ApiKey:
        key = self.keys.authenticate(request.headers.get("Authorization"))
        if key is None:
            raise ApiError(
                401, "a valid API key is required (Authorization: Bearer KEY)",
                code="invalid_api_key",
            )  # fmt: skip
        return key

    # ------------------------------------------------------------------ health, models
    def _health_allowed(self, request: web.Request) -> None:
        if not request.app.get("open") and not self.settings.open_health:
            self._authenticate(request)

    async def healthz(self, request: web.Request) -> web.Response:
        self._health_allowed(request)
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        self._health_allowed(request)
        batches = self.batches is None or self.batches.ready
        if self.bridge.ready.is_set() and self.bridge.failure is None and batches:
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "not ready"}, status=503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        self._health_allowed(request)
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        self._authenticate(request)
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvgate"}
            for name in self.routes
        ]
        return web.json_response({"object": "list", "data": data})

    # ------------------------------------------------------------------ generation
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, RESPONSES)

    async def tokenize(self, request: web.Request) -> web.Response:
        return web.json_response(tokenize(*await self._tokenizer_input(request)))

    async def detokenize(self, request: web.Request) -> web.Response:
        return web.json_response(detokenize(*await self._tokenizer_input(request)))

    async def _tokenizer_input(self, request: web.Request) -> tuple[object, TextCodec]:
        """The body and the tokenizer of the model it names (the only one, when it names
        none)."""
        self._rate_limit(self._authenticate(request))
        raw = await json_body(request, self.settings)
        name = raw.get("model") if isinstance(raw, dict) else None
        if name is None and len(self.routes) == 1:
            name = next(iter(self.routes))
        if name not in self.routes:
            raise ApiError(
                404, f"the model '{name}' does not exist", param="model", code="model_not_found"
            )
        codec = self.codecs[name]
        if codec is None:
            raise bad_field("model", f"this gateway has no tokenizer for '{name}' (--tokenizer)")
        return raw, codec

    async def _generate(self, request: web.Request, door: Door) -> web.StreamResponse:
        received = time.monotonic()
        key = self._authenticate(request)
        self._rate_limit(key)
        if not self.bridge.ready.is_set():
            raise ApiError(503, "the gateway is not connected to Kafka", type_="server_error")
        raw = await json_body(request, self.settings)
        body = door.parse(raw)
        route = self.routes.get(body.model)
        if route is None:
            raise ApiError(
                404, f"the model '{body.model}' does not exist", param="model",
                code="model_not_found",
            )  # fmt: skip
        priority = body.priority if body.priority is not None else key.priority
        if priority < key.min_priority:
            raise bad_field(
                "priority", f"this API key may ask for priority {key.min_priority} or above "
                "(lower is more important)",
            )  # fmt: skip
        chosen = idempotency_key(request, body.request_id)
        request_id = (
            scoped_request_id(chosen, key.tenant_name) if chosen else f"gw-{uuid.uuid4().hex}"
        )
        trace_id = client_trace_id(request)
        try:
            mapped = door.map(
                body, request_id=request_id, priority=priority,
                default_max_tokens=self.settings.default_max_tokens, reply=self.bridge.reply,
            )  # fmt: skip
        except ValidationError as exc:
            raise _record_field_error(exc) from None
        tenant = {"tenant": key.tenant_name}  # the key's tenant (fair sharing, quotas)
        mapped = dataclasses.replace(mapped, request=mapped.request.model_copy(update=tenant))
        # Echoed on every answer from here on: the client's X-Request-Id, else the request's id.
        echo = {REQUEST_ID_HEADER: trace_id or request_id}
        labels = request_labels(route.name, priority)
        known = self.bridge.known_answer(request_id)
        waiter, new = self.bridge.join(request_id)
        try:
            if known is not None:
                waiter.resolve(known)
            elif new:
                look_up = route.result_topic if chosen is not None else None
                await self._send(route, mapped, look_up, trace_id, door.operation)
            if mapped.stream:
                streamer = door.streamer(body, mapped, self.codecs[route.name], route.name)
                return await self._stream(
                    request, route, mapped, waiter, new, received, labels, echo, door, streamer
                )
            result = await self._wait(waiter, request_id, new)
            answer = self._json_answer(result, route, door, body, mapped, received, labels)
            answer.headers.update(echo)
            return answer
        except ApiError as exc:
            exc.headers.update(echo)
            raise
        finally:
            self.bridge.leave(request_id, waiter)

    async def _send(
        self, route: ModelRoute, mapped: Mapped, look_up: str | None, trace_id: str | None,
        operation: str,
    ) -> None:  # fmt: skip
        """Produce the request inside a PRODUCER span whose context travels in the record's
        ``traceparent`` header: the admission service's request span becomes its child. The
        client's X-Request-Id (``trace_id``) is recorded on the span."""
        attributes: dict[str, Any] = {
            attr.GEN_AI_OPERATION_NAME: operation,
            attr.GEN_AI_PROVIDER_NAME: attr.GEN_AI_PROVIDER,
            attr.GEN_AI_REQUEST_MODEL: route.name,
            attr.GEN_AI_RESPONSE_ID: mapped.request.request_id,
            attr.MESSAGING_SYSTEM: "kafka",
            attr.MESSAGING_DESTINATION: route.request_topic,
        }
        if trace_id is not None:
            attributes[attr.HTTP_REQUEST_HEADER_X_REQUEST_ID] = [trace_id]
        with self._tracer.start_as_current_span(
            f"send {route.request_topic}", kind=SpanKind.PRODUCER, attributes=attributes
        ) as span:
            context = span.get_span_context()
            headers = (
                [(TRACEPARENT_HEADER, traceparent_of(context).encode())]
                if context.is_valid
                else None
            )
            try:
                await self.bridge.send(
                    route.request_topic, mapped.request, look_up_in=look_up, headers=headers
                )
            except KafkaError as exc:
                span.set_status(Status(StatusCode.ERROR, repr(exc)))
                raise ApiError(
                    503, f"the request could not be written to Kafka ({exc!r})",
                    type_="server_error",
                ) from None  # fmt: skip

    def _rate_limit(self, key: ApiKey) -> None:
        retry_after = self.limiter.take(key)
        if retry_after is not None:
            self.metrics.rate_limited.labels(key=key.name).inc()
            raise ApiError(
                429, f"rate limit of API key '{key.name}' exceeded", type_="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(max(1, math.ceil(retry_after)))},
            )  # fmt: skip

    async def _wait(self, waiter: Waiter, request_id: str, new: bool) -> InferenceResult:
        try:
            return await asyncio.wait_for(
                asyncio.shield(waiter.result), self.settings.request_timeout_s
            )
        except TimeoutError:
            self._abort(request_id, "timeout", new)
            raise ApiError(
                504, f"no answer within {self.settings.request_timeout_s:g} s", type_="timeout",
                code="timeout",
            ) from None  # fmt: skip
        except asyncio.CancelledError:
            self._abort(request_id, "disconnect", new)
            raise

    def _abort(self, request_id: str, reason: str, new: bool) -> None:
        """Abort in the background (the handler may be cancelled): only the HTTP request that
        sent the Kafka request aborts it, and only while no answer is in."""
        waiter = self.bridge.waiters.get(request_id)
        if self._closing or not new or (waiter is not None and waiter.result.done()):
            return
        self.metrics.aborts.labels(reason=reason).inc()
        task = asyncio.create_task(self.bridge.abort(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _observe(self, result: InferenceResult, received: float, labels: dict[str, str]) -> None:
        m = self.metrics
        m.e2e.labels(**labels).observe(time.monotonic() - received)
        if result.timings.queued_s is not None:
            m.queue.labels(**labels).observe(result.timings.queued_s)
        m.prompt_tokens.labels(**labels).inc(result.usage.prompt_tokens)
        m.generation_tokens.labels(**labels).inc(result.usage.completion_tokens)

    def _json_answer(
        self, result: InferenceResult, route: ModelRoute, door: Door, body: Body,
        mapped: Mapped, received: float, labels: dict[str, str],
    ) -> web.Response:  # fmt: skip
        error = result_error(result, chat=door.chat)
        if error is not None:
            raise error
        self._observe(result, received, labels)
        codec = self.codecs[route.name]
        return web.json_response(
            door.answer(result, body, route.name, int(time.time()), mapped, codec)
        )

    async def _stream(
        self, request: web.Request, route: ModelRoute, mapped: Mapped, waiter: Waiter,
        new: bool, received: float, labels: dict[str, str], echo: dict[str, str], door: Door,
        chunks: Streamer,
    ) -> web.StreamResponse:  # fmt: skip
        """Server-sent events: nothing is sent before the first token or the result, so a
        rejection still gets its HTTP status; the first token opens the stream (headers, and
        the door's opening chunks) even when its text is held back. What each token and the
        result send is the door's ``Streamer``'s business."""
        rid = mapped.request.request_id
        response: web.StreamResponse | None = None
        deadline = received + self.settings.request_timeout_s
        last_token: float | None = None

        async def send(event: dict[str, Any] | str | None) -> None:
            """Write ``event`` (None: only open the stream: headers, and chat's role chunk)."""
            nonlocal response
            if response is None:
                response = web.StreamResponse(
                    headers={
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                        **echo,
                    }
                )
                await response.prepare(request)
                for opening in chunks.opening():
                    await response.write(_sse(opening))
            if event is not None:
                await response.write(_sse(event))

        try:
            # Only the HTTP request that produced the record reads its tokens; one that joined
            # it (the same request id, in flight here) streams the answer when it is in.
            while new and not (waiter.result.done() and waiter.tokens.empty()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                getting: asyncio.Future[Any] = asyncio.ensure_future(waiter.tokens.get())
                result_future: asyncio.Future[Any] = waiter.result
                done, _ = await asyncio.wait(
                    [getting, result_future], timeout=remaining,
                    return_when=asyncio.FIRST_COMPLETED,
                )  # fmt: skip
                if getting not in done:
                    getting.cancel()
                    continue
                chunk = getting.result()
                now = time.monotonic()
                if last_token is None:
                    self.metrics.ttft.labels(**labels).observe(now - received)
                else:
                    self.metrics.itl.labels(**labels).observe(now - last_token)
                last_token = now
                if response is None:  # the first token opens the stream
                    await send(None)
                for event in chunks.token(chunk):
                    await send(event)
            remaining = max(0.0, deadline - time.monotonic())
            result = await asyncio.wait_for(asyncio.shield(waiter.result), remaining)
            error = result_error(result, chat=door.chat)
            if error is not None:
                if response is None:
                    raise error
                await send(error.body())
            else:
                self._observe(result, received, labels)
                if response is None:
                    await send(None)
                for event in chunks.finish(result):
                    await send(event)
            await send("[DONE]")
        except TimeoutError:
            self._abort(rid, "timeout", new)
            error = ApiError(504, "no answer in time", type_="timeout", code="timeout")
            if response is None:
                raise error from None
            await send(error.body())
        except (ConnectionResetError, asyncio.CancelledError):
            self._abort(rid, "disconnect", new)
            raise
        assert response is not None
        await response.write_eof()
        return response


def _sse(event: dict[str, Any] | str) -> bytes:
    data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _record_field_error(exc: ValidationError) -> ApiError:
    """A value the OpenAI fields allow but the Kafka record does not (token ids below 0, say)
    as a 400 naming the field."""
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"]) or "body"
    return bad_field(str(error["loc"][0]) if error["loc"] else where, f"{where}: {error['msg']}")
