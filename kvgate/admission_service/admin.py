"""The admin HTTP API (aiohttp): executor membership, drains, health, readiness, metrics.

```
GET  /v1/executors               -> ExecutorMembership
PUT  /v1/executors               <- ExecutorSet      replace the membership (admin token)
GET  /v1/executors/{name}        -> ExecutorStatus   ("drained" once a draining one is empty)
POST /v1/executors/{name}/drain  -> ExecutorStatus   (admin token)
GET  /healthz                    200 while the service runs its loops (503 once one failed)
GET  /readyz                     200 once it consumes Kafka; 503 while starting, stopping, or
                                 while Kafka does not answer (the body says why)
GET  /metrics                    Prometheus text
```

Readiness deliberately does not require a connected executor: the operator pushes the
membership through this very API (via the pool's Service, which only routes to ready pods), so
requiring executors would deadlock a fresh pool. A Kafka outage fails readiness but not
liveness: a restart cannot bring the broker back and would drop the work in flight (both bodies
name the outage). Mutations need ``Authorization: Bearer
<admin token>``; with no token configured they are refused (403). Bodies are parsed with the
``admin_api`` models (pydantic's JSON parser, which stops at 200 levels of nesting); a bad body
is answered 422 with an ``AdminError`` naming the problem. The API is served by
``kvgate.web.guard`` (:meth:`AdminApi.runner`): a malformed request — an unknown path or method,
an oversized request line, header or body, a body that does not arrive in time — is a 4xx with an
``AdminError`` too, never a 500 or a dropped connection.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from http import HTTPStatus

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from kvgate.admission_service.engine import Engine
from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.protocol.admin import AdminError, ExecutorMembership, ExecutorSet, QueueLoad
from kvgate.web.guard import GuardedRunner, HttpLimits, Refusal, guarded_app, read_body

log = logging.getLogger(__name__)


def _json(body: BaseModel, status: int = 200) -> web.Response:
    return web.Response(status=status, text=body.model_dump_json(), content_type="application/json")


def _error(status: int, error: str, detail: str | None = None) -> web.Response:
    return _json(AdminError(error=error, detail=detail), status)


DEFAULT_LIMITS = HttpLimits()  # the admin settings' defaults (AdminSettings.http_limits)


def _refused(refusal: Refusal) -> web.Response:
    """A request refused for its shape, size or pace, as an ``AdminError``."""
    response = _error(refusal.status, HTTPStatus(refusal.status).phrase.lower(), refusal.message)
    response.headers.update(refusal.headers)
    return response


class AdminApi:
    def __init__(
        self,
        engine: Engine,
        metrics: ServiceMetrics,
        *,
        token: str | None,
        ready: Callable[[], bool],
        healthy: Callable[[], bool],
        outage: Callable[[], str | None] = lambda: None,
        queue: Callable[[], QueueLoad] | None = None,
        limits: HttpLimits = DEFAULT_LIMITS,
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._token = token.encode() if token else None
        self._ready = ready
        self._healthy = healthy
        self._outage = outage  # why a dependency (Kafka) does not answer, else None
        self._queue = queue
        self._limits = limits  # of every request (admin.head_timeout_s, body_timeout_s, ...)

    def app(self) -> web.Application:
        app = guarded_app(self._limits, _refused)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics_text)
        app.router.add_get("/v1/executors", self._membership)
        app.router.add_put("/v1/executors", self._set_membership)
        app.router.add_get("/v1/executors/{name}", self._status)
        app.router.add_post("/v1/executors/{name}/drain", self._drain)
        return app

    def runner(self) -> GuardedRunner:
        """The runner to serve :meth:`app` with (the guard of the module docstring)."""
        return GuardedRunner(self.app(), self._limits, _refused, access_log=None)

    def _refusal(self, request: web.Request) -> web.Response | None:
        if self._token is None:
            return _error(403, "forbidden", "no admin token is configured: mutations are off")
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        # surrogateescape: header bytes that are not UTF-8 give a mismatch (401), not a 500.
        offered = credentials.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(offered, self._token):
            return _error(401, "unauthorized", "a valid admin bearer token is required")
        return None

    async def _healthz(self, _request: web.Request) -> web.Response:
        if not self._healthy():
            return web.Response(status=503, text="unhealthy\n")
        outage = self._outage()
        return web.Response(text="ok\n" if outage is None else f"ok ({outage})\n")

    async def _readyz(self, _request: web.Request) -> web.Response:
        if not self._ready():
            return web.Response(status=503, text="not ready\n")
        outage = self._outage()
        if outage is not None:
            return web.Response(status=503, text=f"not ready: {outage}\n")
        return web.Response(text="ready\n")

    async def _metrics_text(self, _request: web.Request) -> web.Response:
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _membership(self, _request: web.Request) -> web.Response:
        statuses = [h.status() for h in self._engine.handles.values()]
        queue = self._queue() if self._queue is not None else None
        return _json(ExecutorMembership(executors=statuses, queue=queue))

    async def _set_membership(self, request: web.Request) -> web.Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        try:
            wanted = ExecutorSet.model_validate_json(await read_body(request, self._limits))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(body)"
            return _error(422, "invalid executor set", f"{where}: {first['msg']}")
        names = [spec.name for spec in wanted.executors]
        if len(set(names)) != len(names):
            return _error(422, "invalid executor set", f"duplicate executor names in {names}")
        await self._engine.set_members(wanted.executors)
        log.info("membership set to %s", names)
        return await self._membership(request)

    async def _status(self, request: web.Request) -> web.Response:
        handle = self._engine.handles.get(request.match_info["name"])
        if handle is None:
            return _error(404, "unknown executor", request.match_info["name"])
        return _json(handle.status())

    async def _drain(self, request: web.Request) -> web.Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        status = self._engine.drain(request.match_info["name"])
        if status is None:
            return _error(404, "unknown executor", request.match_info["name"])
        log.info("executor %s draining", status.name)
        return _json(status)
