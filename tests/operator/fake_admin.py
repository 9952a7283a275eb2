"""A stand-in for the admission service's admin API (``kvgate/protocol/admin.py``).

It serves the real request and answer bodies (validated with the same pydantic models), checks
the bearer token on mutations, and keeps membership the way the service would: executors join
ready, a drain stops new work and the executor reports ``drained`` once its running requests
reach zero. Tests control that work (``set_running``) and can make the API unavailable.

Every call is journaled with a sequence number shared with the Kubernetes emulator, so a test
can assert that the drain call came before the pod's deletion.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from kvgate.protocol.admin import (
    AdminError,
    ExecutorMembership,
    ExecutorSet,
    ExecutorState,
    ExecutorStatus,
    QueueLoad,
)
from tests.operator.local_http import serve_locally, successful_calls


@dataclass(frozen=True)
class AdminCall:
    seq: int
    method: str
    path: str
    body: Any
    status: int


@dataclass
class _Member:
    endpoint: str
    state: ExecutorState = ExecutorState.READY
    running: int = 0

    def status(self, name: str) -> ExecutorStatus:
        return ExecutorStatus(
            name=name,
            endpoint=self.endpoint,
            state=self.state,
            running_requests=self.running,
            waiting_requests=0,
            kv_blocks_used=self.running,
            kv_blocks_total=64,
        )


@dataclass
class FakeAdminApi:
    token: Callable[[], str | None]  # the valid admin token, read when a request arrives
    sequence: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    journal: list[AdminCall] = field(default_factory=list)
    members: dict[str, _Member] = field(default_factory=dict)
    unavailable: bool = False
    queue: QueueLoad | None = None  # the load reading the autoscaler gets (None: not reported)
    _runner: web.AppRunner | None = None
    url: str = ""

    # --- control and inspection for tests ---------------------------------------------------

    def set_running(self, name: str, running: int) -> None:
        member = self.members[name]
        member.running = running
        if member.state is ExecutorState.DRAINING and running == 0:
            member.state = ExecutorState.DRAINED

    def calls(self, method: str, path_prefix: str = "") -> list[AdminCall]:
        return successful_calls(self.journal, method, path_prefix)

    # --- server -----------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        app = web.Application(middlewares=[self._journal_middleware])
        app.router.add_get("/v1/executors", self._get_membership)
        app.router.add_put("/v1/executors", self._put_membership)
        app.router.add_post("/v1/executors/{name}/drain", self._drain)
        app.router.add_get("/v1/executors/{name}", self._get_executor)
        app.router.add_get("/healthz", self._ok)
        app.router.add_get("/readyz", self._ok)
        app.router.add_get("/metrics", self._metrics)
        self._runner, self.url = await serve_locally(app, host, port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _journal_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        text = await request.text() if request.can_read_body else ""
        try:
            body = json.loads(text) if text else None
        except ValueError:
            body = text
        if self.unavailable and request.path.startswith("/v1/"):
            response: web.StreamResponse = web.json_response(
                AdminError(error="unavailable").model_dump(), status=503
            )
        else:
            response = await handler(request)
        self.journal.append(
            AdminCall(next(self.sequence), request.method, request.path, body, response.status)
        )
        async with self.changed:
            self.changed.notify_all()
        return response

    @staticmethod
    def _error(status: int, error: str, detail: str | None = None) -> web.Response:
        return web.json_response(AdminError(error=error, detail=detail).model_dump(), status=status)

    def _authorised(self, request: web.Request) -> bool:
        token = self.token()
        return token is not None and request.headers.get("Authorization") == f"Bearer {token}"

    def _membership(self) -> ExecutorMembership:
        return ExecutorMembership(
            executors=[member.status(name) for name, member in sorted(self.members.items())],
            queue=self.queue,
        )

    async def _get_membership(self, request: web.Request) -> web.Response:
        return web.json_response(self._membership().model_dump(mode="json"))

    async def _put_membership(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return self._error(401, "unauthorized", "missing or wrong admin token")
        try:
            wanted = ExecutorSet.model_validate_json(await request.text())
        except ValidationError as error:
            return self._error(422, "invalid body", str(error))
        kept: dict[str, _Member] = {}
        for spec in wanted.executors:
            member = self.members.get(spec.name)
            if member is None or member.endpoint != spec.endpoint:
                member = _Member(endpoint=spec.endpoint)
            if spec.draining and member.state is ExecutorState.READY:
                member.state = ExecutorState.DRAINING
            if member.state is ExecutorState.DRAINING and member.running == 0:
                member.state = ExecutorState.DRAINED
            kept[spec.name] = member
        self.members = kept
        return web.json_response(self._membership().model_dump(mode="json"))

    async def _drain(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return self._error(401, "unauthorized", "missing or wrong admin token")
        name = request.match_info["name"]
        member = self.members.get(name)
        if member is None:
            return self._error(404, "unknown executor", name)
        if member.state is ExecutorState.READY:
            member.state = ExecutorState.DRAINING
        if member.state is ExecutorState.DRAINING and member.running == 0:
            member.state = ExecutorState.DRAINED
        return web.json_response(member.status(name).model_dump(mode="json"))

    async def _get_executor(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        member = self.members.get(name)
        if member is None:
            return self._error(404, "unknown executor", name)
        return web.json_response(member.status(name).model_dump(mode="json"))

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f"kvgate_admin_executors {len(self.members)}\n")
