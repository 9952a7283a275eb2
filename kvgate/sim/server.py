"""``kvgate sim-executor``: a simulated executor behind the real WebSocket step protocol.

The same endpoints and session rules as ``kvgate executor`` (bearer token, epoch fencing with a
reset per accepted session, results in plan order, ``/healthz`` and ``/readyz``), with the
deterministic simulated model instead of weights: integration tests and benchmarks use it where
the model is not the point, and it starts in a fraction of a second without torch.

``--step-time-ms`` makes every step take at least that long (an executor under load).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import signal
import time
from pathlib import Path

from aiohttp import ClientError, WSMsgType, web
from pydantic import TypeAdapter, ValidationError

from kvgate.protocol import step as wire
from kvgate.sim.backend import SimBackend, SimExecutorConfig
from kvgate.sim.workload import ExitMode

log = logging.getLogger("kvgate.sim_executor")
TOKEN_ENV = "KVGATE_EXECUTOR_TOKEN"
_CLIENT_MESSAGE: TypeAdapter[wire.SessionOpen | wire.StepPlan] = TypeAdapter(wire.ClientMessage)


class SimExecutorServer:
    def __init__(self, backend: SimBackend, token: str, *, step_time_s: float = 0.0) -> None:
        if not token:
            raise ValueError("the simulated executor needs a non-empty bearer token")
        self.backend = backend
        self._token = token.encode()
        self._step_time_s = step_time_s
        self._current: web.WebSocketResponse | None = None
        self._lock = asyncio.Lock()
        self._fencing: set[asyncio.Task[None]] = set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._ok)
        app.router.add_get("/readyz", self._ok)
        app.router.add_get("/v1/steps", self._steps)
        app.on_shutdown.append(self._close_current)
        return app

    async def _ok(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _close_current(self, _app: web.Application) -> None:
        if self._current is not None:
            await self._current.close()

    def _authorized(self, request: web.Request) -> bool:
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            credentials.strip().encode(), self._token
        )

    async def _error(self, ws: web.WebSocketResponse, code: wire.ErrorCode, text: str) -> None:
        """Tell the peer why, then close; a peer that is already gone is not waited for."""
        with contextlib.suppress(ConnectionError, ClientError):
            await ws.send_str(wire.ProtocolError(code=code, message=text).model_dump_json())
        with contextlib.suppress(ConnectionError, ClientError):
            await ws.close()

    async def _steps(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return web.Response(status=401, text="bearer token required\n")
        ws = web.WebSocketResponse(max_msg_size=64 * 2**20, heartbeat=30.0)
        await ws.prepare(request)
        msg = await ws.receive(timeout=30.0)
        try:
            opening = (
                _CLIENT_MESSAGE.validate_json(msg.data) if msg.type is WSMsgType.TEXT else None
            )
        except ValidationError:
            opening = None
        if not isinstance(opening, wire.SessionOpen):
            await self._error(
                ws, wire.ErrorCode.PROTOCOL, "the first message must be a SessionOpen"
            )
            return ws
        async with self._lock:
            refusal = self.backend.accept(opening.epoch)
            if refusal is not None:
                await self._error(ws, refusal.code, refusal.message)
                return ws
            previous, self._current = self._current, ws
            if previous is not None and not previous.closed:
                # Fenced in the background: the old peer may be dead, and its close handshake
                # must not delay the new session.
                text = f"session epoch {opening.epoch} replaced this one"
                fencing = asyncio.create_task(
                    self._error(previous, wire.ErrorCode.STALE_EPOCH, text)
                )
                self._fencing.add(fencing)
                fencing.add_done_callback(self._fencing.discard)
            accepted = wire.SessionAccepted(epoch=opening.epoch, info=self.backend.info)
            await ws.send_str(accepted.model_dump_json())
        async for msg in ws:
            if self._current is not ws or msg.type is not WSMsgType.TEXT:
                break
            try:
                plan = _CLIENT_MESSAGE.validate_json(msg.data)
            except ValidationError as exc:
                await self._error(ws, wire.ErrorCode.PROTOCOL, f"unparseable message: {exc}")
                break
            if not isinstance(plan, wire.StepPlan):
                await self._error(ws, wire.ErrorCode.PROTOCOL, "session already open")
                break
            await self.backend.wait_released()  # a held backend (tests) answers nothing
            began = time.perf_counter()
            result = self.backend.execute(plan)
            remaining = self._step_time_s - (time.perf_counter() - began)
            if remaining > 0:
                await asyncio.sleep(remaining)  # emulated compute time of a loaded executor
            if self._current is not ws:
                break
            try:
                await ws.send_str(result.model_dump_json())
            except (ConnectionError, ClientError):
                break  # the admission service went away
        return ws


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SimExecutorConfig()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--executor-id", default=defaults.executor_id)
    parser.add_argument("--token-file", type=Path, help=f"bearer token file (else ${TOKEN_ENV})")
    parser.add_argument("--num-blocks", type=int, default=defaults.num_blocks)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--host-snapshot-blocks", type=int, default=0)
    parser.add_argument("--loops", type=int, default=defaults.loops)
    parser.add_argument("--min-loops", type=int, default=defaults.min_loops)
    parser.add_argument("--exit", choices=[m.value for m in ExitMode], default=defaults.exit.value)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--eos-token-id", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-time-ms", type=float, default=0.0)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    token = (
        args.token_file.read_text().strip() if args.token_file else os.environ.get(TOKEN_ENV, "")
    )
    if not token.strip():
        log.error("no bearer token: set $%s or pass --token-file", TOKEN_ENV)
        return 2
    try:
        config = SimExecutorConfig(
            executor_id=args.executor_id,
            loops=args.loops,
            min_loops=args.min_loops,
            exit=ExitMode(args.exit),
            vocab_size=args.vocab_size,
            seed=args.seed,
            eos_token_id=args.eos_token_id,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            host_snapshot_blocks=args.host_snapshot_blocks,
        )
    except ValidationError as exc:
        log.error("invalid simulated executor: %s", exc)
        return 2
    server = SimExecutorServer(SimBackend(config), token, step_time_s=args.step_time_ms / 1000)
    return asyncio.run(_serve(server, args.host, args.port))


async def _serve(server: SimExecutorServer, host: str, port: int) -> int:
    runner = web.AppRunner(server.app())
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("simulated executor listening on %s:%d", host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        return 0
    finally:
        await runner.cleanup()
