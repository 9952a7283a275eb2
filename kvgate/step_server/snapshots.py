"""The executor's side of KV snapshot migration: serve exports, fetch and stage imports.

```
GET  /v1/snapshots/{ticket}   "Authorization: Bearer <token>": the snapshot exported under the
                              one-time ticket, as checksummed frames (kvgate.protocol.migration);
                              404 unknown/taken/expired, 401 without the token
POST /v1/snapshots/import     "Authorization: Bearer <token>", JSON SnapshotImport: fetch the
                              ticket from the source executor (with this executor's token),
                              check every frame, the size limit and the layout, and stage it
                              for the plan that adopts it -> 200 SnapshotStaged, or an error
                              status with a TransferRefusal naming the failure
```

An export is held for its plan's ``ttl_s`` and then dropped; a staged import for
``staged_ttl_s``. Staging is bounded (``max_staged_bytes``, ``max_concurrent_imports``): a
receiver that is full answers 503 ``busy`` and the admission service falls back to recompute,
so a slow receiver never piles snapshots up. Frames go out one at a time through aiohttp's
write, which waits for the socket to drain (TCP backpressure end to end).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import aiohttp
from aiohttp import web
from pydantic import ValidationError
from yarl import URL

from kvgate.protocol import migration
from kvgate.protocol import step as wire
from kvgate.protocol.migration import (
    SnapshotHeader,
    SnapshotImport,
    SnapshotLayout,
    SnapshotStaged,
    TransferError,
    TransferFailure,
    TransferRefusal,
)
from kvgate.web.guard import HttpLimits, read_body

log = logging.getLogger(__name__)

_STATUS = {
    TransferFailure.UNAUTHORIZED: 401,
    TransferFailure.NOT_FOUND: 404,
    TransferFailure.SENDER_GONE: 502,
    TransferFailure.CHECKSUM: 502,
    TransferFailure.TOO_LARGE: 413,
    TransferFailure.MALFORMED: 502,
    TransferFailure.LAYOUT_MISMATCH: 409,
    TransferFailure.NO_HOST_ROOM: 507,
    TransferFailure.BUSY: 503,
    TransferFailure.TIMEOUT: 504,
    TransferFailure.RECEIVER_LOST: 503,
    TransferFailure.NO_RECEIVER: 503,
}


@runtime_checkable
class MigratesSnapshots(Protocol):
    """A backend that can hand its exported snapshots out and stage another's."""

    @property
    def snapshot_layout(self) -> SnapshotLayout: ...

    def take_export(self, ticket: str) -> tuple[SnapshotHeader, bytes] | None: ...

    def drop_export(self, ticket: str) -> None: ...

    def stage_import(self, ticket: str, header: SnapshotHeader, payload: bytes) -> None: ...

    def drop_staged(self, ticket: str) -> None: ...


@dataclass(frozen=True, slots=True)
class MigrationLimits:
    max_snapshot_bytes: int = 16 * 2**30
    max_staged_bytes: int = 32 * 2**30
    max_concurrent_imports: int = 4
    chunk_bytes: int = migration.DEFAULT_CHUNK_BYTES
    fetch_timeout_s: float = 120.0
    staged_ttl_s: float = 60.0


def stage(
    backend: MigratesSnapshots,
    ticket: str,
    request_id: str,
    header: SnapshotHeader,
    payload: bytes,
) -> SnapshotStaged:
    """Stage a checked snapshot on ``backend`` (call on its worker thread)."""
    if header.request_id != request_id:
        raise TransferError(
            TransferFailure.MALFORMED,
            f"the ticket holds {header.request_id!r}, not {request_id!r}",
        )
    try:
        backend.stage_import(ticket, header, payload)
    except ValueError as exc:
        raise TransferError(TransferFailure.LAYOUT_MISMATCH, str(exc)) from exc
    return SnapshotStaged(
        request_id=request_id,
        num_pages=header.num_pages,
        num_blocks=header.num_pages * header.layout.num_planes,
        payload_bytes=header.payload_bytes,
    )


def decode_frames(
    frames: Iterable[bytes], *, max_bytes: int, layout: SnapshotLayout
) -> tuple[SnapshotHeader, bytes]:
    decoder = migration.FrameDecoder(max_bytes=max_bytes, layout=layout)
    for chunk in frames:
        decoder.feed(chunk)
    return decoder.result()


class SnapshotEndpoints:
    """The two migration endpoints of one step server (its token, worker thread and backend)."""

    def __init__(
        self,
        *,
        authorized: Callable[[web.Request], bool],
        token: str,
        worker: ThreadPoolExecutor,
        backend: Callable[[], object | None],
        limits: MigrationLimits,
        http_limits: HttpLimits,
    ) -> None:
        self._authorized = authorized
        self.http_limits = http_limits  # of the import request's body
        self._token = token
        self._worker = worker
        self._backend = backend
        self.limits = limits
        self._staged: dict[str, int] = {}  # ticket -> bytes, until adopted or expired
        self._staged_bytes = 0
        self._importing = 0
        self._timers: set[asyncio.TimerHandle] = set()
        self.exports_served = 0
        self.imports_staged = 0
        self.imports_refused: dict[str, int] = {}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(migration.IMPORT_PATH, self._import)
        app.router.add_get(migration.SNAPSHOTS_PATH + "/{ticket}", self._export)

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    def _migrating(self) -> MigratesSnapshots | None:
        backend = self._backend()
        return backend if isinstance(backend, MigratesSnapshots) else None

    def after_plan(self, plan: wire.StepPlan) -> None:
        """Start the clocks of the exports a plan made (on the event loop, after it ran)."""
        backend = self._migrating()
        if backend is None:
            return
        for export in plan.export:
            self._later(export.ttl_s, backend.drop_export, export.ticket)
        for adopt in plan.adopt:
            self._unstage(adopt.ticket)

    def _later(self, delay_s: float, drop: Callable[[str], None], ticket: str) -> None:
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.discard(timer)
            self._unstage(ticket)
            loop.run_in_executor(self._worker, drop, ticket)

        timer = loop.call_later(delay_s, fire)
        self._timers.add(timer)

    # ------------------------------------------------------------------------ the sender

    async def _export(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return _refusal(TransferFailure.UNAUTHORIZED, "bearer token required")
        backend = self._migrating()
        if backend is None:
            return _refusal(TransferFailure.NOT_FOUND, "this executor exports no snapshots")
        ticket = request.match_info["ticket"]
        loop = asyncio.get_running_loop()
        taken = await loop.run_in_executor(self._worker, backend.take_export, ticket)
        if taken is None:
            return _refusal(TransferFailure.NOT_FOUND, "no snapshot under this ticket")
        header, payload = taken
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        for chunk in migration.encode(header, payload, self.limits.chunk_bytes):
            await response.write(chunk)
        await response.write_eof()
        self.exports_served += 1
        return response

    # ---------------------------------------------------------------------- the receiver

    async def _import(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _refusal(TransferFailure.UNAUTHORIZED, "bearer token required")
        try:
            asked = SnapshotImport.model_validate_json(await read_body(request, self.http_limits))
        except ValidationError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        if not _is_http_base(asked.source):  # the caller's mistake (400), not a failed fetch
            return web.json_response({"error": "source must be an http(s) URL"}, status=400)
        backend = self._migrating()
        if backend is None:
            return self._refused(TransferFailure.LAYOUT_MISMATCH, "this executor imports nothing")
        limits = self.limits
        if self._importing >= limits.max_concurrent_imports:
            return self._refused(TransferFailure.BUSY, "too many imports at once")
        self._importing += 1
        try:
            header, payload = await asyncio.wait_for(
                self._fetch(asked, backend.snapshot_layout), limits.fetch_timeout_s
            )
            if self._staged_bytes + len(payload) > limits.max_staged_bytes:
                raise TransferError(TransferFailure.BUSY, "the staging area is full")
            loop = asyncio.get_running_loop()
            staged = await loop.run_in_executor(
                self._worker, stage, backend, asked.ticket, asked.request_id, header, payload
            )
        except TimeoutError:
            return self._refused(
                TransferFailure.TIMEOUT, f"no snapshot in {limits.fetch_timeout_s} s"
            )
        except TransferError as exc:
            return self._refused(exc.failure, exc.message)
        finally:
            self._importing -= 1
        self._staged[asked.ticket] = staged.payload_bytes
        self._staged_bytes += staged.payload_bytes
        self.imports_staged += 1
        self._later(limits.staged_ttl_s, self._expire_staged, asked.ticket)
        return web.Response(text=staged.model_dump_json(), content_type="application/json")

    def _expire_staged(self, ticket: str) -> None:
        """On the worker thread: a staged import nobody adopted in time is dropped."""
        backend = self._migrating()
        if backend is not None:
            backend.drop_staged(ticket)

    def _unstage(self, ticket: str) -> None:
        self._staged_bytes -= self._staged.pop(ticket, 0)

    def _refused(self, failure: TransferFailure, message: str) -> web.Response:
        self.imports_refused[failure.value] = self.imports_refused.get(failure.value, 0) + 1
        log.warning("snapshot import refused (%s): %s", failure.value, message)
        return _refusal(failure, message)

    async def _fetch(
        self, asked: SnapshotImport, layout: SnapshotLayout
    ) -> tuple[SnapshotHeader, bytes]:
        url = f"{asked.source.rstrip('/')}{migration.SNAPSHOTS_PATH}/{asked.ticket}"
        decoder = migration.FrameDecoder(max_bytes=self.limits.max_snapshot_bytes, layout=layout)
        headers = {"Authorization": f"Bearer {self._token}"}
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.get(url, headers=headers) as response,
            ):
                if response.status != 200:
                    raise _failure_of(response.status, await response.text())
                async for chunk in response.content.iter_chunked(self.limits.chunk_bytes):
                    decoder.feed(chunk)
        except (aiohttp.ClientError, OSError) as exc:
            raise TransferError(TransferFailure.SENDER_GONE, f"{url}: {exc!r}") from exc
        return decoder.result()


def _is_http_base(source: str) -> bool:
    try:
        url = URL(source)
    except ValueError:
        return False
    return url.scheme in ("http", "https") and bool(url.host)


def _failure_of(status: int, text: str) -> TransferError:
    try:
        refusal = TransferRefusal.model_validate_json(text)
    except ValidationError:
        return TransferError(TransferFailure.SENDER_GONE, f"HTTP {status}: {text[:200]}")
    return TransferError(refusal.failure, f"the sender says: {refusal.message}")


def _refusal(failure: TransferFailure, message: str) -> web.Response:
    body = TransferRefusal(failure=failure, message=message).model_dump_json()
    headers = {"WWW-Authenticate": "Bearer"} if failure is TransferFailure.UNAUTHORIZED else None
    return web.Response(
        status=_STATUS[failure], text=body, content_type="application/json", headers=headers
    )
