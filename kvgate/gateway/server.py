"""The HTTP side: OpenAI routes over the reply bridge, health and metrics.

One request is a sequence of named phases (``_generate``): authenticate → rate-limit → parse
→ route → idempotency → produce → answer (JSON, or server-sent events from the token stream).
A client that goes away (aiohttp cancels the handler, or a write fails) or a request that
outlives ``request_timeout_s`` is aborted on the pool's abort topic.
"""

from __future__ import annotations

import asyncio
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

from kvgate.admission_service.tokenizer import TextCodec, load_tokenizer
from kvgate.gateway.auth import KeyRing, RateLimiter
from kvgate.gateway.detokenize import StreamText
from kvgate.gateway.metrics import GatewayMetrics, priority_class
from kvgate.gateway.openai_api import (
    ApiError,
    ChatBody,
    CompletionBody,
    Mapped,
    bad_field,
    checked_request_id,
    parse_body,
    to_request,
)
from kvgate.gateway.replies import ReplyBridge, Waiter
from kvgate.gateway.responses import (
    ChunkMaker,
    chat_body,
    completion_body,
    result_error,
)
from kvgate.gateway.settings import ApiKey, GatewaySettings, ModelRoute
from kvgate.protocol.records import TRACEPARENT_HEADER, InferenceResult
from kvgate.telemetry import attributes as attr
from kvgate.telemetry.context import traceparent_of

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"


class Gateway:
    def __init__(self, settings: GatewaySettings, tracer: trace.Tracer | None = None) -> None:
        self.settings = settings
        self._tracer = tracer or trace.get_tracer("kvgate.gateway")
        self.bridge = ReplyBridge(settings)
        self.keys = KeyRing(settings.keys, allow_anonymous=settings.allow_anonymous)
        self.limiter = RateLimiter()
        self.metrics = GatewayMetrics()
        self.routes = {m.name: m for m in settings.models}
        self.codecs: dict[str, TextCodec | None] = {
            m.name: load_tokenizer(m.tokenizer_file) if m.tokenizer_file else None
            for m in settings.models
        }
        self._background: set[asyncio.Task[None]] = set()
        self._closing = False
        self._runners: list[web.AppRunner] = []
        self.port: int | None = None
        self.health_port: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        health = [
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.metrics_page),
        ]
        app.add_routes(health)
        return app

    def health_app(self) -> web.Application:
        app = web.Application()
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
        await self.bridge.start()
        self.port = await self._serve(self.app(), self.settings.port)
        if self.settings.health_port is not None:
            self.health_port = await self._serve(self.health_app(), self.settings.health_port)

    async def _serve(self, app: web.Application, port: int) -> int:
        # handler_cancellation: a client that disconnects cancels its handler (-> abort).
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
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
        await self.bridge.close()

    # ------------------------------------------------------------------ middleware
    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
        except ApiError as exc:
            response = web.json_response(exc.body(), status=exc.status, headers=exc.headers)
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
        if self.bridge.ready.is_set() and self.bridge.failure is None:
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
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        received = time.monotonic()
        key = self._authenticate(request)
        self._rate_limit(key)
        if not self.bridge.ready.is_set():
            raise ApiError(503, "the gateway is not connected to Kafka", type_="server_error")
        body = parse_body(ChatBody if chat else CompletionBody, await _json(request))
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
        header_id = request.headers.get(REQUEST_ID_HEADER)
        chosen = body.request_id or (checked_request_id(header_id) if header_id else None)
        request_id = chosen or f"gw-{uuid.uuid4().hex}"
        mapped = to_request(
            body, request_id=request_id, priority=priority,
            default_max_tokens=self.settings.default_max_tokens, reply=self.bridge.reply,
        )  # fmt: skip
        labels = {"model": route.name, "priority_class": priority_class(priority)}
        known = self.bridge.known_answer(request_id)
        waiter, new = self.bridge.join(request_id)
        try:
            if known is not None:
                waiter.resolve(known)
            elif new:
                look_up = route.result_topic if chosen is not None else None
                await self._send(route, mapped, look_up, chat=chat)
            if mapped.stream:
                return await self._stream(request, route, mapped, waiter, new, received, labels)
            result = await self._wait(waiter, request_id, new)
            return self._json_answer(result, route, chat=chat, received=received, labels=labels)
        finally:
            self.bridge.leave(request_id, waiter)

    async def _send(
        self, route: ModelRoute, mapped: Mapped, look_up: str | None, *, chat: bool
    ) -> None:
        """Produce the request inside a PRODUCER span whose context travels in the record's
        ``traceparent`` header: the admission service's request span becomes its child."""
        operation = attr.GEN_AI_OPERATION_CHAT if chat else attr.GEN_AI_OPERATION_TEXT_COMPLETION
        with self._tracer.start_as_current_span(
            f"send {route.request_topic}",
            kind=SpanKind.PRODUCER,
            attributes={
                attr.GEN_AI_OPERATION_NAME: operation,
                attr.GEN_AI_PROVIDER_NAME: attr.GEN_AI_PROVIDER,
                attr.GEN_AI_REQUEST_MODEL: route.name,
                attr.GEN_AI_RESPONSE_ID: mapped.request.request_id,
                attr.MESSAGING_SYSTEM: "kafka",
                attr.MESSAGING_DESTINATION: route.request_topic,
            },
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
        self, result: InferenceResult, route: ModelRoute, *, chat: bool, received: float,
        labels: dict[str, str],
    ) -> web.Response:  # fmt: skip
        error = result_error(result, chat=chat)
        if error is not None:
            raise error
        self._observe(result, received, labels)
        build = chat_body if chat else completion_body
        return web.json_response(
            build(result, route.name, int(time.time())),
            headers={REQUEST_ID_HEADER: result.request_id},
        )

    async def _stream(
        self, request: web.Request, route: ModelRoute, mapped: Mapped, waiter: Waiter,
        new: bool, received: float, labels: dict[str, str],
    ) -> web.StreamResponse:  # fmt: skip
        """Server-sent events: nothing is sent before the first token or the result, so a
        rejection still gets its HTTP status; the first token opens the stream (headers, and
        chat's role chunk) even when its text is held back."""
        rid = mapped.request.request_id
        chat = isinstance(mapped.request.messages, list)
        chunks = ChunkMaker(rid, route.name, chat=chat)
        text = StreamText(self.codecs[route.name], mapped.request.stop)
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
                        REQUEST_ID_HEADER: rid,
                    }
                )
                await response.prepare(request)
                first = chunks.first()
                if first is not None:
                    await response.write(_sse(first))
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
                delta = text.add(chunk.token_id)
                if delta or response is None:  # the first token opens the stream
                    await send(chunks.text(delta) if delta else None)
            remaining = max(0.0, deadline - time.monotonic())
            result = await asyncio.wait_for(asyncio.shield(waiter.result), remaining)
            error = result_error(result, chat=chat)
            if error is not None:
                if response is None:
                    raise error
                await send(error.body())
            else:
                self._observe(result, received, labels)
                final = text.finish(result.text or "")
                if final:
                    await send(chunks.text(final))
                await send(chunks.text("", finish=result.finish_reason or "abort"))
                if mapped.include_usage:
                    await send(chunks.usage(result))
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


async def _json(request: web.Request) -> object:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
