"""HTTP servers that answer every malformed request with a 4xx in the API's own error shape.

aiohttp refuses a request it cannot parse (a request line or header over its limit, too many
headers, bytes that are not HTTP) with a plain-text 400, after logging a traceback at ERROR;
it closes the socket with the rest of the request unread, so the peer's kernel may answer the
unread bytes with a reset that destroys the 400 before the client reads it. Three servers face
that: the gateway's OpenAI port (clients on the internet, through an Ingress), the admission
service's admin API and the executors' step port. :class:`GuardedRunner` serves an app instead
of ``web.AppRunner`` and changes, per connection:

- a request line over ``max_request_line_bytes`` is a 414, a header over
  ``max_header_field_bytes`` or more than ``max_headers`` of them a 431, anything else the
  parser refuses a 400 — each rendered by the app's ``render`` (the OpenAI error object on the
  gateway, ``AdminError`` on the admin API), logged as one line without a traceback;
- after such a refusal the connection half-closes (the response, then FIN) and reads and drops
  what the client still sends for up to ``linger_s``, so the response arrives whole;
- a request head that starts must be complete within ``head_timeout_s`` (a client that sends its
  headers a byte at a time holds a connection that long, not forever).

Inside the app, :func:`refusals` renders aiohttp's own errors (404 unknown path, 405 method,
413 body) and :class:`Refusal` the same way, and :func:`read_body` reads a body within
``max_body_bytes`` and ``body_timeout_s`` (413, 408), refusing compressed bodies (415).

aiohttp offers no hook for parse errors or for the protocol class, so this subclasses its server
and request handler, overrides one private method (``_make_error_handler``) and reads a few
private attributes (each marked "private" where it is read). tests/reliability/
test_hostile_http.py sends every kind of malformed request at real processes and would fail on
an aiohttp whose internals moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import hdrs, web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong
from aiohttp.http_parser import RawRequestMessage
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

_MESSAGE_CHARS: Final = 200  # of a client's path or bytes quoted back in a refusal


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one request may be, and how long it may take to arrive."""

    max_request_line_bytes: int = 4096  # method, path and version; 414 above
    max_header_field_bytes: int = 8190  # one header, name and value; 431 above
    max_headers: int = 100  # 431 above
    max_body_bytes: int = 1 << 20  # 413 above
    head_timeout_s: float = 10.0  # first byte of a request to the end of its headers
    body_timeout_s: float = 30.0  # the whole body, once the headers are in; 408 after
    linger_s: float = 2.0  # after a refusal, the rest of the request is read and dropped

    def __post_init__(self) -> None:
        sizes = (self.max_request_line_bytes, self.max_header_field_bytes, self.max_body_bytes)
        times = (self.head_timeout_s, self.body_timeout_s, self.linger_s)
        if min(sizes) < 1 or self.max_headers < 1 or min(times) <= 0:
            raise ValueError(f"HTTP limits must be positive: {self}")
        # The parser reports which limit a line crossed, not what the line was: the two limits
        # must differ for a 414 and a 431 to be told apart.
        if self.max_request_line_bytes == self.max_header_field_bytes:
            raise ValueError("max_request_line_bytes and max_header_field_bytes must differ")


class Refusal(Exception):
    """A request refused for what it is (its shape, size or pace), with the HTTP status."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


Render = Callable[[Refusal], web.Response]
"""The app's error body for a refusal (the OpenAI error object, ``AdminError``, plain text)."""


def malformed_status(exc: HttpProcessingError, limits: HttpLimits) -> int:
    """The status of a request the parser refused: 414, 431, or 400."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else None
        return 414 if limit == limits.max_request_line_bytes else 431
    if exc.message.startswith("Too many headers"):
        return 431
    return 400


_PHRASES: Final = {
    400: "the request is not well-formed HTTP",
    414: "the request line is longer than {line} bytes",
    431: "a header is longer than {field} bytes, or there are more than {count} headers",
}


def plain_text_refusal(refusal: Refusal) -> web.Response:
    """A refusal as a plain-text body (servers whose errors are text)."""
    return web.Response(status=refusal.status, text=refusal.message + "\n")


# ---------------------------------------------------------------------------- the runner


class _GuardedProtocol(RequestHandler):
    """One connection: aiohttp's request handler with the refusal, lingering close and head
    timeout of the module docstring."""

    def __init__(
        self, manager: web.Server, *, limits: HttpLimits, render: Render, **kwargs: Any
    ) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._render = render
        self._refused = False  # a malformed request was answered: drop what else comes
        self._awaiting_head = True  # no complete request head since the last response
        self._head_timer: asyncio.TimerHandle | None = None
        self._gone: asyncio.Future[None] = self._loop.create_future()

    # A request head must be complete within head_timeout_s of its first byte.
    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the rest of a refused request, read and dropped (lingering close)
        heads = self._request_count  # private: counts the messages parsed on this connection
        super().data_received(data)
        if self._request_count != heads:
            self._awaiting_head = False
            self._stop_head_timer()
            last = self._messages[-1][0] if self._messages else None  # private: parsed queue
            if last is not None and not isinstance(last, RawRequestMessage):
                self._refused = True  # a parse error: no later request on this connection
        elif self._awaiting_head and self._head_timer is None and data:
            self._head_timer = self._loop.call_later(
                self._limits.head_timeout_s, self._head_timed_out
            )

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._request_in_progress:  # private: a handler is running
            log.info("closed a connection whose request head did not arrive in time")
            self.force_close()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if isinstance(resp, web.HTTPException) and resp.status >= 400:
            # Raised outside the app's middlewares (an unmet Expect header is refused before
            # them): rendered here instead.
            resp = self._render(refusal_of(resp, request))
        answered = await super().finish_response(request, resp, start_time)
        # A body left unread is drained by aiohttp (lingering) and the connection closed: only
        # after a complete request can the next bytes be a new head.
        self._awaiting_head = request.content.is_eof()
        return answered

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_timer()
        if not self._gone.done():
            self._gone.set_result(None)
        super().connection_lost(exc)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's last resort for an exception out of the app. A write that failed because
        this client went away (aiohttp's own ``100 Continue``, say) is nobody's error: no
        traceback, and no answer anyone could read. Anything else is a bug, and logged so."""
        transport = self.transport
        gone = transport is None or transport.is_closing()
        if gone and isinstance(exc, ConnectionError):
            log.debug("the client left during its request (%r)", exc)
            response = web.Response(status=400, text="the connection is closed\n")
            response.force_close()
            return response
        return super().handle_error(request, status, exc, message)

    # A request the parser refused: a 4xx in the app's shape, then a lingering close. Private:
    # aiohttp answers parse errors through this method, outside the app and its middlewares.
    def _make_error_handler(self, err_info: Any) -> Callable[[web.BaseRequest], Awaitable[Any]]:
        exc = err_info.exc

        async def refuse(request: web.BaseRequest) -> web.StreamResponse:
            if not isinstance(exc, HttpProcessingError):
                return self.handle_error(request, err_info.status, exc, err_info.message)
            status = malformed_status(exc, self._limits)
            detail = _PHRASES[status].format(
                line=self._limits.max_request_line_bytes,
                field=self._limits.max_header_field_bytes,
                count=self._limits.max_headers,
            )
            first = self._request_count == 1
            level = logging.DEBUG if first and isinstance(exc, BadHttpMethod) else logging.INFO
            what = exc.message[:_MESSAGE_CHARS].replace("\n", " ")
            log.log(level, "refused a request from %s: %d %s", request.remote, status, what)
            response = self._render(Refusal(status, detail))
            response.force_close()
            self._refused = True
            with contextlib.suppress(OSError):  # the client is gone (reset): nobody to tell
                await response.prepare(request)
                await response.write_eof()
                await self._linger()
            return response

        return refuse

    async def _linger(self) -> None:
        """Half-close (FIN after the response), then let the peer's remaining bytes arrive and
        be dropped until it closes or ``linger_s`` passes: closing with unread bytes makes the
        kernel send a reset, which can destroy the response in flight."""
        transport = self.transport
        if transport is None or self._gone.done():
            return
        if transport.can_write_eof():
            transport.write_eof()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._gone), self._limits.linger_s)


class _GuardedServer(web.Server):
    def __init__(self, *args: Any, limits: HttpLimits, render: Render, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._render = render

    def __call__(self) -> RequestHandler:
        return _GuardedProtocol(
            self, limits=self._limits, render=self._render, loop=self._loop, **self._kwargs
        )


class GuardedRunner(web.AppRunner):
    """``web.AppRunner`` for ``app`` with :class:`HttpLimits` and ``render`` (the module
    docstring). The app should come from :func:`guarded_app` (its body limit, and
    :func:`refusals` for aiohttp's own errors)."""

    def __init__(
        self, app: web.Application, limits: HttpLimits, render: Render, **kwargs: Any
    ) -> None:
        super().__init__(
            app,
            max_line_size=limits.max_request_line_bytes,
            max_field_size=limits.max_header_field_bytes,
            max_headers=limits.max_headers,
            lingering_time=limits.linger_s,
            auto_decompress=False,  # compressed bodies are refused (read_body), not inflated
            **kwargs,
        )
        self._limits = limits
        self._render = render

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # The same server (the app's handler and request factory, the handler arguments built
        # above), making guarded connections. Private: the server's loop and handler arguments.
        return _GuardedServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            limits=self._limits,
            render=self._render,
            **server._kwargs,
        )


# --------------------------------------------------------------------------- inside the app


def guarded_app(
    limits: HttpLimits,
    render: Render = plain_text_refusal,
    middlewares: tuple[Callable[..., Awaitable[web.StreamResponse]], ...] = (),
) -> web.Application:
    """An application whose bodies are limited to ``limits.max_body_bytes`` and whose errors
    (404, 405, 413, :class:`Refusal`) are rendered by ``render``; ``middlewares`` run outside
    that, so they see the rendered response."""
    return web.Application(
        client_max_size=limits.max_body_bytes, middlewares=[*middlewares, refusals(render)]
    )


def refusals(render: Render) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Middleware: :class:`Refusal` and aiohttp's HTTP errors become ``render``'s body."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except Refusal as refusal:
            response = render(refusal)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = render(refusal_of(exc, request))
        if not request.content.is_eof():
            response.force_close()  # the rest of the body is drained (lingering), then closed
        return response

    return middleware


def refusal_of(exc: web.HTTPException, request: web.BaseRequest) -> Refusal:
    """aiohttp's error (raised by its router, by ``read()`` over the body limit, or for an
    unmet ``Expect``) as a refusal that names what was asked for; headers such as ``Allow``
    are kept."""
    path = request.path[:_MESSAGE_CHARS]
    kept = {k: v for k, v in exc.headers.items() if k not in _BODY_HEADERS}
    if exc.status == 404:
        return Refusal(404, f"no such path: {path}", kept)
    if exc.status == 405:
        allowed = exc.headers.get(hdrs.ALLOW, "")
        method = request.method[:20]
        return Refusal(405, f"{method} is not allowed on {path} (allowed: {allowed})", kept)
    if exc.status == 413:
        return Refusal(413, "the request body is too large", kept)
    return Refusal(exc.status, exc.reason, kept)


_BODY_HEADERS: Final = frozenset({hdrs.CONTENT_TYPE, hdrs.CONTENT_LENGTH})
_UNCOMPRESSED: Final = frozenset({"", "identity"})


async def read_body(request: web.Request, limits: HttpLimits) -> bytes:
    """The request's body: uncompressed, at most ``limits.max_body_bytes`` (413, refused before
    reading when ``Content-Length`` says so), complete within ``limits.body_timeout_s`` (408)."""
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
    if encoding not in _UNCOMPRESSED:
        accepted = f"Content-Encoding {encoding[:40]!r} is not accepted"
        raise Refusal(415, f"{accepted}: send the body uncompressed")
    too_large = Refusal(413, f"the request body is larger than {limits.max_body_bytes} bytes")
    length = request.content_length
    if length is not None and length > limits.max_body_bytes:
        raise too_large
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            return await request.read()
    except TimeoutError:
        raise Refusal(408, f"the body did not arrive within {limits.body_timeout_s:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except (web.RequestPayloadError, ConnectionError) as exc:
        # A malformed chunked body, or a client gone before its body arrived (then nobody
        # reads the answer: it only keeps the handler from failing with a traceback).
        raise Refusal(400, f"the body could not be read ({exc})") from None
