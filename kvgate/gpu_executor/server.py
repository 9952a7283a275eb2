"""The executor's network face (aiohttp): the step WebSocket, health, readiness and metrics.

```
GET /healthz     200 while the process can serve (503 if loading the model failed)
GET /readyz      200 once weights are loaded and the KV cache allocated, else 503
GET /metrics     Prometheus text
GET /v1/steps    WebSocket, "Authorization: Bearer <token>" required:
                 SessionOpen(epoch) -> SessionAccepted | ProtocolError,
                 then StepPlan* -> StepResult* (in order)
```
Epoch fencing: a SessionOpen is accepted only with an epoch above every epoch accepted before;
accepting one closes the older session (ProtocolError STALE_EPOCH) and resets the executor.
Plans run strictly in order on one worker thread while the socket reader keeps accepting the
next plan, so an admission service can keep one plan in flight (async scheduling).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import WSCloseCode, WSMsgType, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import TypeAdapter, ValidationError

from kvgate.gpu_executor.executor import Executor
from kvgate.gpu_executor.metrics import ExecutorMetrics
from kvgate.protocol import step as wire

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 2**20
OPEN_TIMEOUT_S = 30.0
_CLIENT_MESSAGE: TypeAdapter[wire.SessionOpen | wire.StepPlan] = TypeAdapter(wire.ClientMessage)


@dataclass(eq=False)
class _Session:
    epoch: int
    session_id: str
    ws: web.WebSocketResponse
    queue: asyncio.Queue[wire.StepPlan | wire.StepResult | None] = field(
        default_factory=asyncio.Queue
    )
    fenced: bool = False  # read by the worker thread before each plan


class ExecutorServer:
    """Serves one executor; ``load`` builds it (in a thread, so health answers meanwhile)."""

    def __init__(
        self,
        load: Callable[[], Executor],
        token: str,
        *,
        metrics: ExecutorMetrics | None = None,
    ):
        if not token:
            raise ValueError("the executor needs a non-empty bearer token")
        self._load = load
        self._token = token.encode()
        self.metrics = metrics or ExecutorMetrics()
        self.executor: Executor | None = None
        self.load_error: BaseException | None = None
        self._loaded = asyncio.Event()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-step")
        self._max_epoch: int | None = None
        self._session: _Session | None = None
        self._open_lock = asyncio.Lock()
        self._load_task: asyncio.Task[None] | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/steps", self._steps)
        app.on_startup.append(self._start_loading)
        app.on_shutdown.append(self._close_session)
        app.on_cleanup.append(self._stop_worker)
        return app

    async def wait_loaded(self) -> Executor:
        """The executor once loaded; raises what loading raised."""
        await self._loaded.wait()
        if self.executor is None:
            assert self.load_error is not None
            raise self.load_error
        return self.executor

    # ------------------------------------------------------------------------- lifecycle

    async def _start_loading(self, _app: web.Application) -> None:
        self._load_task = asyncio.create_task(self._load_executor())

    async def _load_executor(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            executor = await loop.run_in_executor(self._worker, self._load)
        except Exception as exc:
            log.exception("loading the model failed")
            self.load_error = exc
        else:
            self.executor = executor
            self.metrics.ready.set(1)
            self.metrics.blocks_total.set(executor.info.num_blocks)
            log.info("executor ready: %s", executor.info.model_dump_json())
        finally:
            self._loaded.set()

    async def _close_session(self, _app: web.Application) -> None:
        """On shutdown: stop the session's plans and close its socket as "going away"."""
        session = self._session
        if session is not None:
            session.fenced = True
            session.queue.put_nowait(None)
            await session.ws.close(code=WSCloseCode.GOING_AWAY, message=b"executor shutting down")

    async def _stop_worker(self, _app: web.Application) -> None:
        if self._load_task is not None:
            await asyncio.gather(self._load_task, return_exceptions=True)
        self._worker.shutdown(wait=True)

    # ------------------------------------------------------------------------ endpoints

    async def _healthz(self, _request: web.Request) -> web.Response:
        if self.load_error is not None:
            return web.Response(status=503, text=f"model load failed: {self.load_error}\n")
        return web.Response(text="ok\n")

    async def _readyz(self, _request: web.Request) -> web.Response:
        if self.executor is None:
            return web.Response(status=503, text="loading\n")
        return web.Response(text="ready\n")

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _authorized(self, request: web.Request) -> bool:
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            credentials.strip().encode(), self._token
        )

    async def _steps(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            self.metrics.sessions.labels(outcome="unauthorized").inc()
            return web.Response(
                status=401, text="bearer token required\n", headers={"WWW-Authenticate": "Bearer"}
            )
        if self.executor is None:
            return web.Response(status=503, text="not ready\n")
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES, heartbeat=30.0)
        await ws.prepare(request)
        session = await self._open(ws)
        if session is None:
            return ws
        worker = asyncio.create_task(self._run_plans(session))
        try:
            await self._read_plans(session)
        finally:
            session.queue.put_nowait(None)
            await worker
            if self._session is session:
                self._session = None
            await ws.close()
        return ws

    # ------------------------------------------------------------------------- sessions

    async def _reject(self, ws: web.WebSocketResponse, code: wire.ErrorCode, message: str) -> None:
        error = wire.ProtocolError(code=code, message=message)
        await ws.send_str(error.model_dump_json())
        await ws.close()

    async def _open(self, ws: web.WebSocketResponse) -> _Session | None:
        try:
            msg = await ws.receive(timeout=OPEN_TIMEOUT_S)
        except TimeoutError:
            await self._reject(ws, wire.ErrorCode.PROTOCOL, "no SessionOpen in time")
            return None
        opening = _parse(msg.data) if msg.type is WSMsgType.TEXT else None
        if not isinstance(opening, wire.SessionOpen):
            self.metrics.sessions.labels(outcome="protocol_error").inc()
            await self._reject(
                ws, wire.ErrorCode.PROTOCOL, "the first message must be a SessionOpen"
            )
            return None
        if opening.protocol_version != wire.PROTOCOL_VERSION:
            self.metrics.sessions.labels(outcome="protocol_error").inc()
            await self._reject(
                ws,
                wire.ErrorCode.PROTOCOL,
                f"protocol version {opening.protocol_version}; this executor speaks "
                f"{wire.PROTOCOL_VERSION}",
            )
            return None
        async with self._open_lock:
            if self._max_epoch is not None and opening.epoch <= self._max_epoch:
                self.metrics.sessions.labels(outcome="stale").inc()
                await self._reject(
                    ws,
                    wire.ErrorCode.STALE_EPOCH,
                    f"epoch {opening.epoch} is not newer than accepted epoch {self._max_epoch}",
                )
                return None
            self._max_epoch = opening.epoch
            session = _Session(opening.epoch, opening.session_id, ws)
            previous, self._session = self._session, session
            if previous is not None:
                await self._fence(previous, f"session epoch {opening.epoch} replaced this one")
            executor = self.executor
            assert executor is not None
            # On the worker thread, after any plan of the fenced session already running there.
            await asyncio.get_running_loop().run_in_executor(self._worker, executor.reset)
            self.metrics.sessions.labels(outcome="accepted").inc()
            self.metrics.epoch.set(opening.epoch)
            self._report_held(executor.counters)  # the reset dropped what was held
            accepted = wire.SessionAccepted(epoch=opening.epoch, info=executor.info)
            await ws.send_str(accepted.model_dump_json())
            log.info("session %s accepted at epoch %d", opening.session_id, opening.epoch)
            return session

    def _report_held(self, counters: wire.ExecutorCounters) -> None:
        self.metrics.requests.set(counters.num_requests)
        self.metrics.snapshots.set(counters.num_snapshots)
        self.metrics.host_blocks.set(counters.host_blocks_used)

    async def _fence(self, session: _Session, reason: str) -> None:
        session.fenced = True
        session.queue.put_nowait(None)
        if not session.ws.closed:
            error = wire.ProtocolError(code=wire.ErrorCode.STALE_EPOCH, message=reason)
            with contextlib.suppress(ConnectionError):
                await session.ws.send_str(error.model_dump_json())
            await session.ws.close()

    # ---------------------------------------------------------------------------- plans

    async def _read_plans(self, session: _Session) -> None:
        async for msg in session.ws:
            if session.fenced:
                return
            if msg.type is not WSMsgType.TEXT:
                if msg.type is WSMsgType.ERROR:
                    return
                await self._reject(
                    session.ws, wire.ErrorCode.PROTOCOL, "messages must be text JSON"
                )
                return
            try:
                message = _CLIENT_MESSAGE.validate_json(msg.data)
            except ValidationError as exc:
                step_id = _step_id(msg.data)
                if step_id is None:
                    await self._reject(session.ws, wire.ErrorCode.PROTOCOL, _first_error(exc))
                    return
                # A plan we cannot parse still gets its answer, in order with the others.
                error = wire.StepError(code=wire.ErrorCode.BAD_PLAN, message=_first_error(exc))
                session.queue.put_nowait(wire.StepResult(step_id=step_id, error=error))
                continue
            if isinstance(message, wire.SessionOpen):
                await self._reject(session.ws, wire.ErrorCode.PROTOCOL, "session already open")
                return
            session.queue.put_nowait(message)

    async def _run_plans(self, session: _Session) -> None:
        loop = asyncio.get_running_loop()
        while (item := await session.queue.get()) is not None:
            if session.fenced:
                return
            if isinstance(item, wire.StepResult):
                result: wire.StepResult | None = item
                self.metrics.observe(item, 0, 0)
            else:
                result = await loop.run_in_executor(self._worker, self._execute, session, item)
                if result is not None:
                    self.metrics.observe(
                        result, len(item.prefill_rows), len(item.decode.request_ids)
                    )
            if result is None or session.ws.closed:
                return
            try:
                await session.ws.send_str(result.model_dump_json())
            except ConnectionError:
                # The admission service vanished mid-step (killed: its socket is reset, not
                # closed). Its successor opens a new epoch, which resets this executor.
                log.info(
                    "session %s: the peer is gone; dropping step %d's result",
                    session.session_id,
                    result.step_id,
                )
                return

    def _execute(self, session: _Session, plan: wire.StepPlan) -> wire.StepResult | None:
        """On the worker thread: a fenced session's plans must not touch the new epoch's state."""
        if session.fenced or self.executor is None:
            return None
        return self.executor.execute(plan)


def _parse(data: str) -> wire.SessionOpen | wire.StepPlan | None:
    try:
        return _CLIENT_MESSAGE.validate_json(data)
    except ValidationError:
        return None


def _step_id(data: str) -> int | None:
    try:
        raw = json.loads(data)
    except json.JSONDecodeError:
        return None
    if not isinstance(raw, dict) or raw.get("type") != "plan":
        return None
    step_id = raw.get("step_id")
    return step_id if isinstance(step_id, int) and step_id >= 1 else None


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"invalid message at {where or 'top level'}: {first['msg']}"
