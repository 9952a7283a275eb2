"""A journaling reverse proxy in front of a real admission service's admin API.

It plays the pool's admission Service: the operator's admin URL points here, and each request
is forwarded to the admission pod once that pod is ready (``upstream``); before that, or when
the pod does not answer, the proxy answers 503 as a Service without ready endpoints would leave
the caller without an answer. Every exchange is journaled with the request body, the status and
the parsed answer, under a sequence number shared with the Kubernetes emulator, so a test can
order admin calls against API writes (the drain call before the pod's deletion) and see what
the service said at each step (when it first reported an executor drained).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvgate.protocol.admin import AdminError, ExecutorState
from tests.operator.local_http import serve_locally, successful_calls

# Only these request headers reach the service: what the operator's admin client sends.
_FORWARDED = ("Authorization", "Content-Type", "Accept")


@dataclass(frozen=True)
class ProxiedCall:
    seq: int
    method: str
    path: str
    body: Any  # the request body (parsed JSON, or text)
    status: int
    answer: Any  # the response body (parsed JSON, or text)


def _parse(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


@dataclass
class JournalingProxy:
    sequence: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    upstream: str | None = None  # the ready admission pod's admin URL; None: no ready pod
    journal: list[ProxiedCall] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    # --- inspection for tests ---------------------------------------------------------------

    def calls(self, method: str, path_prefix: str = "") -> list[ProxiedCall]:
        """Successful calls of one method (and path prefix), in order."""
        return successful_calls(self.journal, method, path_prefix)

    def first_reported(self, name: str, state: ExecutorState) -> int | None:
        """Sequence number of the first answer that gave executor ``name`` in ``state``."""
        for call in self.journal:
            if call.status >= 400 or not isinstance(call.answer, dict):
                continue
            reported = call.answer.get("executors", [call.answer])
            if any(e.get("name") == name and e.get("state") == state for e in reported):
                return call.seq
        return None

    # --- server -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner, self.url = await serve_locally(app)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.Response:
        assert self._session is not None
        text = await request.text() if request.can_read_body else ""
        response = await self._answer(request, text)
        answer_text = response.text or ""
        self.journal.append(
            ProxiedCall(
                next(self.sequence),
                request.method,
                request.path,
                _parse(text),
                response.status,
                _parse(answer_text),
            )
        )
        async with self.changed:
            self.changed.notify_all()
        return response

    async def _answer(self, request: web.Request, text: str) -> web.Response:
        assert self._session is not None
        if self.upstream is None:
            return _unavailable("no ready admission pod")
        headers = {k: request.headers[k] for k in _FORWARDED if k in request.headers}
        try:
            async with self._session.request(
                request.method,
                self.upstream + request.path_qs,
                headers=headers,
                data=text.encode() if text else None,
            ) as upstream:
                body = await upstream.text()
                return web.Response(
                    status=upstream.status,
                    text=body,
                    content_type=upstream.content_type,
                )
        except (aiohttp.ClientError, TimeoutError) as error:
            return _unavailable(f"the admission pod did not answer: {error!r}")


def _unavailable(detail: str) -> web.Response:
    body = AdminError(error="unavailable", detail=detail).model_dump()
    return web.json_response(body, status=503)
