"""The executor side of the step protocol (aiohttp), for every executor: real or simulated.

```
GET /healthz     200 while the process can serve (503 if loading the backend failed)
GET /readyz      200 once the backend is loaded (weights read, KV cache allocated), else 503
GET /metrics     Prometheus text
GET /v1/tokenizer  "Authorization: Bearer <token>" required: the model's tokenizer
                 (TokenizerFiles JSON), 404 when the model has none, 503 while loading
GET /v1/snapshots/{ticket}, POST /v1/snapshots/import
                 KV snapshot migration (bearer token required): see snapshots.py
GET /v1/steps    WebSocket, "Authorization: Bearer <token>" required:
                 SessionOpen(epoch) -> SessionAccepted | ProtocolError,
                 then StepPlan* -> StepResult* (in order)
```
Sessions follow :class:`~kvgate.protocol.session.EpochFence`: accepting an epoch closes the
older session (ProtocolError STALE_EPOCH) and resets the backend. Plans run strictly in order on
one worker thread while the socket reader keeps accepting the next plan, so an admission service
can keep one plan in flight (async scheduling). A plan that does not parse but names its step
still gets an answer, in order with the others (a BAD_PLAN error).

What is served is a :class:`StepBackend`; the server knows nothing of models or tensors. It is
served by ``kvgate.web.guard`` (:func:`serve`): a malformed request — an unknown path or method,
an oversized request line, header or body, a head or body that does not arrive in time — is a
plain-text 4xx, never a 500 or a dropped connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol, runtime_checkable

from aiohttp import ClientError, WSCloseCode, WSMsgType, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import TypeAdapter, ValidationError

from kvgate.protocol import step as wire
from kvgate.protocol.session import EpochFence
from kvgate.protocol.tokenizer_files import TOKENIZER_PATH, TokenizerFiles
from kvgate.step_server.metrics import ExecutorMetrics
from kvgate.step_server.snapshots import MigrationLimits, SnapshotEndpoints
from kvgate.web.guard import GuardedRunner, HttpLimits, guarded_app, plain_text_refusal

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES: Final = 64 * 2**20
# HTTP requests (the WebSocket's messages have MAX_MESSAGE_BYTES): only small JSON bodies.
STEP_HTTP_LIMITS: Final = HttpLimits()
OPEN_TIMEOUT_S: Final = 30.0
_CLIENT_MESSAGE: TypeAdapter[wire.SessionOpen | wire.StepPlan] = TypeAdapter(wire.ClientMessage)


class StepBackend(Protocol):
    """One executor as the step server drives it; every call runs on the server's worker thread."""

    @property
    def info(self) -> wire.ExecutorInfo: ...

    @property
    def counters(self) -> wire.ExecutorCounters: ...

    def reset(self) -> None:
        """Forget every request and snapshot (a new session starts from nothing)."""

    def execute(self, plan: wire.StepPlan) -> wire.StepResult:
        """Run one plan; a plan it refuses comes back as a result with an error, not a raise."""
        ...


@runtime_checkable
class ServesTokenizer(Protocol):
    """A backend whose model has a tokenizer to hand to the admission service (or None)."""

    @property
    def tokenizer_files(self) -> TokenizerFiles | None: ...


@dataclass(eq=False)
class _Session:
    epoch: int
    session_id: str
    ws: web.WebSocketResponse
    queue: asyncio.Queue[wire.StepPlan | wire.StepResult | None] = field(
        default_factory=asyncio.Queue
    )
    fenced: bool = False  # read by the worker thread before each plan
    protocol_version: int = wire.PROTOCOL_VERSION  # the opener's: results are written in it


class StepServer:
    """Serves one backend; ``load`` builds it (in a thread, so health answers meanwhile).

    ``before_step`` is awaited before each plan runs (a simulated executor holds results back
    with it); ``min_step_time_s`` makes each step take at least that long (an emulated load).
    """

    def __init__(
        self,
        load: Callable[[], StepBackend],
        token: str,
        *,
        metrics: ExecutorMetrics | None = None,
        fence: EpochFence | None = None,
        before_step: Callable[[], Awaitable[None]] | None = None,
        min_step_time_s: float = 0.0,
        migration: MigrationLimits | None = None,
    ):
        if not token:
            raise ValueError("the executor needs a non-empty bearer token")
        self._load = load
        self._token = token.encode()
        self.metrics = metrics or ExecutorMetrics()
        self.fence = fence or EpochFence()
        self._before_step = before_step
        self._min_step_time_s = min_step_time_s
        self.backend: StepBackend | None = None
        self.load_error: BaseException | None = None
        self._loaded = asyncio.Event()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-step")
        self._session: _Session | None = None
        self._open_lock = asyncio.Lock()
        self._load_task: asyncio.Task[None] | None = None
        self._fencing: set[asyncio.Task[None]] = set()  # replaced sessions being told so
        self.snapshots = SnapshotEndpoints(
            authorized=self._authorized,
            token=token,
            worker=self._worker,
            backend=lambda: self.backend,
            limits=migration or MigrationLimits(),
            http_limits=STEP_HTTP_LIMITS,
        )

    def app(self) -> web.Application:
        app = guarded_app(STEP_HTTP_LIMITS)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/steps", self._steps)
        app.router.add_get(TOKENIZER_PATH, self._tokenizer)
        self.snapshots.add_routes(app)
        app.on_startup.append(self._start_loading)
        app.on_shutdown.append(self._close_session)
        app.on_cleanup.append(self._stop_worker)
        return app

    async def wait_loaded(self) -> StepBackend:
        """The backend once loaded; raises what loading raised."""
        await self._loaded.wait()
        if self.backend is None:
            assert self.load_error is not None
            raise self.load_error
        return self.backend

    # ------------------------------------------------------------------------- lifecycle

    async def _start_loading(self, _app: web.Application) -> None:
        self._load_task = asyncio.create_task(self._load_backend())

    async def _load_backend(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            backend = await loop.run_in_executor(self._worker, self._load)
        except Exception as exc:
            log.exception("loading the executor failed")
            self.load_error = exc
        else:
            self.backend = backend
            self.metrics.ready.set(1)
            self.metrics.blocks_total.set(backend.info.num_blocks)
            log.info("executor ready: %s", backend.info.model_dump_json())
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
        self.snapshots.close()
        if self._load_task is not None:
            await asyncio.gather(self._load_task, return_exceptions=True)
        self._worker.shutdown(wait=True)

    # ------------------------------------------------------------------------ endpoints

    async def _healthz(self, _request: web.Request) -> web.Response:
        if self.load_error is not None:
            return web.Response(status=503, text=f"model load failed: {self.load_error}\n")
        return web.Response(text="ok\n")

    async def _readyz(self, _request: web.Request) -> web.Response:
        if self.backend is None:
            return web.Response(status=503, text="loading\n")
        return web.Response(text="ready\n")

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _authorized(self, request: web.Request) -> bool:
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        # surrogateescape: header bytes that are not UTF-8 give a mismatch (401), not a 500.
        offered = credentials.strip().encode("utf-8", "surrogateescape")
        return scheme.lower() == "bearer" and hmac.compare_digest(offered, self._token)

    async def _tokenizer(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.Response(
                status=401, text="bearer token required\n", headers={"WWW-Authenticate": "Bearer"}
            )
        backend = self.backend
        if backend is None:
            return web.Response(status=503, text="not ready\n")
        files = backend.tokenizer_files if isinstance(backend, ServesTokenizer) else None
        if files is None:
            return web.Response(status=404, text="this executor's model has no tokenizer\n")
        return web.Response(text=files.model_dump_json(), content_type="application/json")

    async def _steps(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            self.metrics.sessions.labels(outcome="unauthorized").inc()
            return web.Response(
                status=401, text="bearer token required\n", headers={"WWW-Authenticate": "Bearer"}
            )
        if self.backend is None:
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

    async def _reject(self, ws: web.WebSocketResponse, error: wire.ProtocolError) -> None:
        """Tell the peer why, then close; a peer that is already gone is not waited for."""
        with contextlib.suppress(ConnectionError, ClientError):
            await ws.send_str(error.model_dump_json())
        with contextlib.suppress(ConnectionError, ClientError):
            await ws.close()

    async def _open(self, ws: web.WebSocketResponse) -> _Session | None:
        try:
            msg = await ws.receive(timeout=OPEN_TIMEOUT_S)
        except TimeoutError:
            await self._reject(ws, _protocol_error("no SessionOpen in time"))
            return None
        opening: wire.SessionOpen | wire.StepPlan | None = None
        problem = "the first message must be a SessionOpen"
        if msg.type is WSMsgType.TEXT:
            try:
                opening = _CLIENT_MESSAGE.validate_json(msg.data)
            except ValidationError as exc:
                problem = f"{problem}: {_first_error(exc)}"
        if not isinstance(opening, wire.SessionOpen):
            self.metrics.sessions.labels(outcome="protocol_error").inc()
            await self._reject(ws, _protocol_error(problem))
            return None
        async with self._open_lock:
            refusal = self.fence.accept(opening)
            if refusal is not None:
                stale = refusal.code is wire.ErrorCode.STALE_EPOCH
                self.metrics.sessions.labels(outcome="stale" if stale else "protocol_error").inc()
                await self._reject(ws, refusal)
                return None
            session = _Session(
                opening.epoch, opening.session_id, ws, protocol_version=opening.protocol_version
            )
            previous, self._session = self._session, session
            if previous is not None:
                await self._fence(previous, f"session epoch {opening.epoch} replaced this one")
            backend = self.backend
            assert backend is not None
            # On the worker thread, after any plan of the fenced session already running there.
            await asyncio.get_running_loop().run_in_executor(self._worker, backend.reset)
            self.metrics.sessions.labels(outcome="accepted").inc()
            self.metrics.epoch.set(opening.epoch)
            self._report_held(backend.counters)  # the reset dropped what was held
            accepted = wire.SessionAccepted(epoch=opening.epoch, info=backend.info)
            await ws.send_str(accepted.model_dump_json())
            log.info("session %s accepted at epoch %d", opening.session_id, opening.epoch)
            return session

    def _report_held(self, counters: wire.ExecutorCounters) -> None:
        self.metrics.requests.set(counters.num_requests)
        self.metrics.snapshots.set(counters.num_snapshots)
        self.metrics.host_blocks.set(counters.host_blocks_used)

    async def _fence(self, session: _Session, reason: str) -> None:
        """Stop a replaced session's plans; its peer is told in the background (it may be dead,
        and its close handshake must not delay the new session)."""
        session.fenced = True
        session.queue.put_nowait(None)
        if not session.ws.closed:
            error = wire.ProtocolError(code=wire.ErrorCode.STALE_EPOCH, message=reason)
            task = asyncio.create_task(self._reject(session.ws, error))
            self._fencing.add(task)
            task.add_done_callback(self._fencing.discard)

    # ---------------------------------------------------------------------------- plans

    async def _read_plans(self, session: _Session) -> None:
        async for msg in session.ws:
            if session.fenced:
                return
            if msg.type is not WSMsgType.TEXT:
                if msg.type is WSMsgType.ERROR:
                    return
                await self._reject(session.ws, _protocol_error("messages must be text JSON"))
                return
            try:
                message = _CLIENT_MESSAGE.validate_json(msg.data)
            except ValidationError as exc:
                step_id = _step_id(msg.data)
                if step_id is None:
                    await self._reject(session.ws, _protocol_error(_first_error(exc)))
                    return
                # A plan we cannot parse still gets its answer, in order with the others.
                error = wire.StepError(code=wire.ErrorCode.BAD_PLAN, message=_first_error(exc))
                session.queue.put_nowait(wire.StepResult(step_id=step_id, error=error))
                continue
            if isinstance(message, wire.SessionOpen):
                await self._reject(session.ws, _protocol_error("session already open"))
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
                if self._before_step is not None:
                    await self._before_step()
                began = time.perf_counter()
                result = await loop.run_in_executor(self._worker, self._execute, session, item)
                if result is not None and result.error is None:
                    self.snapshots.after_plan(item)
                if result is not None:
                    self.metrics.observe(
                        result, len(item.prefill_rows), len(item.decode.request_ids)
                    )
                remaining = self._min_step_time_s - (time.perf_counter() - began)
                if remaining > 0:
                    await asyncio.sleep(remaining)  # emulated compute time of a loaded executor
            if result is None or session.ws.closed or session.fenced:
                return
            try:
                await session.ws.send_str(result.to_json(session.protocol_version))
            except (ConnectionError, ClientError):
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
        if session.fenced or self.backend is None:
            return None
        return self.backend.execute(plan)


def _protocol_error(message: str) -> wire.ProtocolError:
    return wire.ProtocolError(code=wire.ErrorCode.PROTOCOL, message=message)


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


# ------------------------------------------------------------------------- the process


TOKEN_ENV: Final = "KVGATE_EXECUTOR_TOKEN"


def read_token(token_file: Path | None) -> str:
    """The bearer token from ``token_file``, else ``$KVGATE_EXECUTOR_TOKEN``; never empty."""
    if token_file is not None:
        token = token_file.read_text().strip()
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(f"no bearer token: set ${TOKEN_ENV} or pass --token-file")
    return token


async def serve(server: StepServer, host: str, port: int) -> int:
    """Serve until SIGINT/SIGTERM (exit 0) or until loading the backend fails (exit 1)."""
    runner = GuardedRunner(server.app(), STEP_HTTP_LIMITS, plain_text_refusal)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("listening on %s:%d", host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loading = asyncio.create_task(server.wait_loaded())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done() and loading.exception() is not None:
            log.error("model load failed: %s", loading.exception())
            return 1
        await stopping
        log.info("shutting down")
        return 0
    finally:
        loading.cancel()
        stopping.cancel()
        await runner.cleanup()
