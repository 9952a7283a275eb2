"""The admission side of the step protocol: one WebSocket session per executor connection.

```
open_session(endpoint, token, epoch)   HTTP upgrade with "Authorization: Bearer <token>"
   SessionOpen(epoch) ──────────▶        the executor fences older epochs and resets itself
              ◀────────── SessionAccepted(info) | ProtocolError → SessionRefused
session.send(plan) / session.receive() results in plan order; a reader task keeps the socket
                                       drained (pings, pongs, close frames) even while idle
```

A session that breaks for any reason — the socket closes, a heartbeat goes unanswered, the
executor sends a ProtocolError (e.g. a newer epoch fenced us out), or a result does not arrive
within ``step_timeout_s`` — raises :class:`SessionLost` from ``receive``. The caller treats the
executor as lost: its requests resume elsewhere by recompute, and it reconnects with a fresh
epoch after a backoff.

Epochs come from :class:`EpochClock`: wall-clock milliseconds, strictly increasing within the
process, so a restarted admission service (a later clock) fences its predecessor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import aiohttp
from pydantic import TypeAdapter, ValidationError

from kvgate.protocol import migration
from kvgate.protocol import step as wire
from kvgate.protocol.migration import (
    SnapshotImport,
    SnapshotStaged,
    TransferError,
    TransferFailure,
    TransferRefusal,
)
from kvgate.protocol.session import wall_clock_ms

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 2**20
_SERVER_MESSAGE: TypeAdapter[wire.SessionAccepted | wire.StepResult | wire.ProtocolError] = (
    TypeAdapter(wire.ServerMessage)
)


class SessionRefused(Exception):
    """The executor would not open a session (bad token, stale epoch, wrong protocol)."""

    def __init__(self, code: wire.ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code


class ConnectFailed(Exception):
    """The executor could not be reached (or did not answer the opening in time)."""


class SessionLost(Exception):
    """An open session broke; nothing more will arrive on it."""

    def __init__(self, reason: str, *, fenced: bool = False) -> None:
        super().__init__(reason)
        self.fenced = fenced  # a newer epoch took the executor over


class EpochClock:
    """Session epochs: wall-clock milliseconds, strictly increasing within this process (what
    executors accept: :class:`~kvgate.protocol.session.EpochFence`)."""

    def __init__(self, now_ms: Callable[[], int] = wall_clock_ms) -> None:
        self._now_ms = now_ms
        self._last = 0

    def next(self) -> int:
        self._last = max(self._now_ms(), self._last + 1)
        return self._last


class StepSession(Protocol):
    """An open session: results arrive in the order plans were sent."""

    @property
    def info(self) -> wire.ExecutorInfo: ...

    async def send(self, plan: wire.StepPlan) -> None: ...

    async def receive(self) -> wire.StepResult: ...

    async def wait_lost(self) -> SessionLost:
        """Returns (with the reason) once the session has broken."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class ImportsSnapshots(Protocol):
    """A session whose executor can fetch a snapshot another executor exported (migration)."""

    async def import_snapshot(
        self, source_endpoint: str, ticket: str, request_id: str, timeout_s: float
    ) -> SnapshotStaged:
        """Have the executor fetch ``ticket`` from ``source_endpoint``'s executor and stage it;
        raises :class:`TransferError` naming why it did not arrive."""
        ...


class Connector(Protocol):
    """Opens a session to ``endpoint`` at ``epoch``; raises SessionRefused or ConnectFailed."""

    async def __call__(self, endpoint: str, epoch: int) -> StepSession: ...


class WebSocketSession:
    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        info: wire.ExecutorInfo,
        step_timeout_s: float,
        *,
        endpoint: str = "",
        http: aiohttp.ClientSession | None = None,
        token: str = "",
    ) -> None:
        self._endpoint = endpoint
        self._http = http
        self._token = token
        self._ws = ws
        self._info = info
        self._step_timeout_s = step_timeout_s
        self._results: asyncio.Queue[wire.StepResult | SessionLost] = asyncio.Queue()
        self._lost: SessionLost | None = None
        self._lost_event = asyncio.Event()
        self._reader = asyncio.create_task(self._read(), name="kvgate-step-reader")

    @property
    def info(self) -> wire.ExecutorInfo:
        return self._info

    async def _read(self) -> None:
        reason = SessionLost("the executor closed the connection")
        try:
            async for msg in self._ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    if msg.type is aiohttp.WSMsgType.ERROR:
                        reason = SessionLost(f"connection error: {self._ws.exception()!r}")
                        break
                    continue  # binary frames are not part of the protocol; ignore them
                try:
                    message = _SERVER_MESSAGE.validate_json(msg.data)
                except ValidationError as exc:
                    reason = SessionLost(f"unparseable message from the executor: {exc}")
                    break
                if isinstance(message, wire.StepResult):
                    self._results.put_nowait(message)
                elif isinstance(message, wire.ProtocolError):
                    fenced = message.code is wire.ErrorCode.STALE_EPOCH
                    reason = SessionLost(f"{message.code.value}: {message.message}", fenced=fenced)
                    break
                else:
                    reason = SessionLost("a second SessionAccepted on an open session")
                    break
            else:
                code = self._ws.close_code
                reason = SessionLost(f"the executor closed the connection (code {code})")
        except (aiohttp.ClientError, ConnectionError) as exc:
            reason = SessionLost(f"connection error: {exc!r}")
        self._lost = reason
        self._lost_event.set()
        self._results.put_nowait(reason)

    async def wait_lost(self) -> SessionLost:
        await self._lost_event.wait()
        assert self._lost is not None
        return self._lost

    async def send(self, plan: wire.StepPlan) -> None:
        if self._lost is not None:
            raise self._lost
        try:
            await self._ws.send_str(plan.model_dump_json())
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
            raise SessionLost(f"sending step {plan.step_id} failed: {exc!r}") from exc

    async def receive(self) -> wire.StepResult:
        try:
            # Not ``wait_for``: on Python 3.11 it can swallow a cancellation that arrives as the
            # result does, and a handle told to leave would then keep its step loop running.
            async with asyncio.timeout(self._step_timeout_s):
                item = await self._results.get()
        except TimeoutError:
            raise SessionLost(f"no step result within {self._step_timeout_s:g} s") from None
        if isinstance(item, SessionLost):
            self._results.put_nowait(item)  # every later receive fails the same way
            raise item
        return item

    async def import_snapshot(
        self, source_endpoint: str, ticket: str, request_id: str, timeout_s: float
    ) -> SnapshotStaged:
        """``POST /v1/snapshots/import`` on this executor: it fetches from the source itself."""
        if self._http is None or self._lost is not None:
            raise TransferError(TransferFailure.RECEIVER_LOST, "the session is not open")
        url = migration.http_base(self._endpoint) + migration.IMPORT_PATH
        body = SnapshotImport(
            source=migration.http_base(source_endpoint), ticket=ticket, request_id=request_id
        )
        try:
            async with self._http.post(
                url,
                data=body.model_dump_json(),
                headers={
                    "Authorization": f"Bearer {self._token}",
                    "Content-Type": "application/json",
                },
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                text = await response.text()
        except TimeoutError as exc:
            raise TransferError(TransferFailure.TIMEOUT, f"{url}: no answer in time") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise TransferError(TransferFailure.RECEIVER_LOST, f"{url}: {exc!r}") from exc
        try:
            if response.status == 200:
                return SnapshotStaged.model_validate_json(text)
            refusal = TransferRefusal.model_validate_json(text)
        except ValidationError:
            raise TransferError(
                TransferFailure.MALFORMED, f"{url}: HTTP {response.status}: {text[:200]}"
            ) from None
        raise TransferError(refusal.failure, refusal.message)

    async def close(self) -> None:
        await self._ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class WebSocketConnector:
    """Opens sessions over WebSocket with a bearer token; one aiohttp client per service."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        token: str,
        *,
        connect_timeout_s: float,
        heartbeat_s: float,
        step_timeout_s: float,
    ) -> None:
        self._http = http
        self._token = token
        self._connect_timeout_s = connect_timeout_s
        self._heartbeat_s = heartbeat_s
        self._step_timeout_s = step_timeout_s

    async def __call__(self, endpoint: str, epoch: int) -> StepSession:
        headers = {"Authorization": f"Bearer {self._token}"}
        try:
            ws = await self._http.ws_connect(
                endpoint,
                headers=headers,
                heartbeat=self._heartbeat_s,
                max_msg_size=MAX_MESSAGE_BYTES,
                timeout=aiohttp.ClientWSTimeout(ws_close=self._connect_timeout_s),
            )
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status == 401:
                raise SessionRefused(wire.ErrorCode.UNAUTHORIZED, "bearer token refused") from exc
            raise ConnectFailed(f"{endpoint}: HTTP {exc.status} {exc.message}") from exc
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise ConnectFailed(f"{endpoint}: {exc or type(exc).__name__}") from exc
        try:
            opening = wire.SessionOpen(epoch=epoch, session_id=uuid.uuid4().hex)
            await ws.send_str(opening.model_dump_json())
            msg = await ws.receive(timeout=self._connect_timeout_s)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            await ws.close()
            raise ConnectFailed(f"{endpoint}: no answer to SessionOpen: {exc!r}") from exc
        if msg.type is not aiohttp.WSMsgType.TEXT:
            await ws.close()
            raise ConnectFailed(f"{endpoint}: connection closed during the opening ({msg.type})")
        try:
            answer = _SERVER_MESSAGE.validate_json(msg.data)
        except ValidationError as exc:
            await ws.close()
            raise ConnectFailed(f"{endpoint}: unparseable opening answer: {exc}") from exc
        if isinstance(answer, wire.ProtocolError):
            await ws.close()
            raise SessionRefused(answer.code, answer.message)
        if not isinstance(answer, wire.SessionAccepted) or answer.epoch != epoch:
            await ws.close()
            raise ConnectFailed(f"{endpoint}: unexpected opening answer {answer!r}")
        log.info("executor %s accepted epoch %d: %s", endpoint, epoch, answer.info.executor_id)
        return WebSocketSession(
            ws,
            answer.info,
            self._step_timeout_s,
            endpoint=endpoint,
            http=self._http,
            token=self._token,
        )
