"""``/v1/files``: upload (multipart, as the ``openai`` client sends it), list, retrieve,
``/content``, delete — OpenAI's file objects, scoped to the API key that uploaded them.

An upload is streamed into the object store as it arrives: the body is never held, only one
multipart chunk at a time (and, on S3, the part being uploaded). Bytes and non-blank lines are
counted on the way; a file over ``max_file_bytes`` or ``max_file_lines`` is a 400 and nothing is
kept (the store drops a write whose stream fails). A ``Content-Length`` over the limit is
refused before anything is read. The whole body must arrive within ``upload_timeout_s``.

Only ``purpose: "batch"`` is accepted (kvgate keeps files for its batches); output and error
files have ``purpose: "batch_output"``. Files expire as OpenAI's do: 30 days after upload
unless ``expires_after`` says otherwise; an expired file is gone (404) and its bytes are
deleted when it is next asked for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from aiohttp import BodyPartReader, MultipartReader, web

from kvgate.batch.book import BatchBook
from kvgate.batch.ids import is_file_id, new_file_id
from kvgate.batch.journal import FileRecord
from kvgate.batch.jsonl import Line, LineSplitter
from kvgate.batch.objects import FilePurpose
from kvgate.batch.settings import BatchSettings
from kvgate.batch.store import ObjectMissing, ObjectStore, file_key
from kvgate.gateway.openai_api import ApiError, bad_field
from kvgate.gateway.settings import ApiKey

log = logging.getLogger(__name__)

DEFAULT_EXPIRY_S: Final = 30 * 86_400  # OpenAI's for batch files
MIN_EXPIRY_S: Final = 3600
MAX_EXPIRY_S: Final = 30 * 86_400
_FIELD_BYTES: Final = 1024  # a form field other than the file (purpose, expires_after[...])
_MULTIPART_SLACK_BYTES: Final = 64 * 1024  # boundaries and part headers around the file
_CHUNK_BYTES: Final = 1 << 20
_LIST_LIMIT: Final = 10_000

Authenticate = Callable[[web.Request], ApiKey]
RateLimit = Callable[[ApiKey], None]


class _TooLarge(Exception):
    """The upload crossed a limit (the message says which)."""


def not_found(file_id: str) -> ApiError:
    return ApiError(404, f"no file with id '{file_id[:80]}'", param="file_id", code="not_found")


class FilesApi:
    def __init__(
        self,
        book: BatchBook,
        store: ObjectStore,
        settings: BatchSettings,
        authenticate: Authenticate,
        rate_limit: RateLimit,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._book = book
        self._store = store
        self._settings = settings
        self._authenticate = authenticate
        self._rate_limit = rate_limit
        self._clock = clock

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/files", self.upload),
            web.get("/v1/files", self.list_files),
            web.get("/v1/files/{file_id}", self.retrieve),
            web.get("/v1/files/{file_id}/content", self.content),
            web.delete("/v1/files/{file_id}", self.delete),
        ]

    # ------------------------------------------------------------------ upload
    async def upload(self, request: web.Request) -> web.StreamResponse:
        key = self._authenticate(request)
        self._rate_limit(key)
        limit = self._settings.max_file_bytes
        if request.content_length is not None and request.content_length > limit + (
            _MULTIPART_SLACK_BYTES
        ):
            return _refuse(
                ApiError(
                    400, f"the file is larger than {limit} bytes", param="file",
                    code="file_too_large",
                )
            )  # fmt: skip
        try:
            async with asyncio.timeout(self._settings.upload_timeout_s):
                return await self._upload(request, key)
        except TimeoutError:
            message = f"the upload did not arrive within {self._settings.upload_timeout_s:g} s"
            return _refuse(ApiError(408, message, code="request_timeout"))
        except _TooLarge as exc:
            return _refuse(ApiError(400, str(exc), param="file", code="file_too_large"))

    async def _upload(self, request: web.Request, key: ApiKey) -> web.Response:
        try:
            reader = await request.multipart()
        except (AssertionError, ValueError, KeyError):
            raise ApiError(400, "send the file as multipart/form-data") from None
        fields: dict[str, str] = {}
        stored: tuple[str, str, int, int] | None = None  # id, filename, bytes, lines
        while (part := await reader.next()) is not None:
            if isinstance(part, MultipartReader) or part.name is None:
                raise ApiError(400, "nested or unnamed multipart parts are not accepted")
            if part.name == "file" and stored is None:
                stored = await self._store_file(part)
            else:
                fields[part.name] = await _small_field(part)
        if stored is None:
            raise bad_field("file", "no file part")
        file_id, filename, size, lines = stored
        try:
            record = self._record(key, fields, file_id, filename, size, lines)
            await self._book.add_file(record)
        except BaseException:
            await self._store.delete(file_key(file_id))
            raise
        return web.json_response(record.api())

    async def _store_file(self, part: BodyPartReader) -> tuple[str, str, int, int]:
        file_id = new_file_id()
        counted = _Counted(part, self._settings)
        await self._store.put(file_key(file_id), counted.chunks())
        return file_id, (part.filename or "upload.jsonl")[:256], counted.size, counted.lines

    def _record(
        self, key: ApiKey, fields: dict[str, str], file_id: str, filename: str, size: int,
        lines: int,
    ) -> FileRecord:  # fmt: skip
        purpose = fields.get("purpose")
        if purpose != FilePurpose.BATCH.value:
            raise bad_field("purpose", "only purpose 'batch' is accepted here")
        if lines == 0:
            raise bad_field("file", "the file has no line")
        now = int(self._clock())
        return FileRecord(
            id=file_id, owner=key.name, filename=filename, purpose=FilePurpose.BATCH,
            bytes=size, lines=lines, created_at=now, expires_at=now + _expiry_s(fields),
        )  # fmt: skip

    # ------------------------------------------------------------------ reading
    async def list_files(self, request: web.Request) -> web.Response:
        key = self._authenticate(request)
        query = request.query
        limit = _int_param(query.get("limit"), "limit", 1, _LIST_LIMIT, _LIST_LIMIT)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_field("order", "order is 'asc' or 'desc'")
        purpose = query.get("purpose")
        files = [f for f in self._book.files_of(key.name) if self._live(f)]
        if purpose is not None:
            files = [f for f in files if f.purpose.value == purpose]
        if order == "asc":
            files.reverse()
        return web.json_response(page([f.api() for f in files], query.get("after"), limit))

    async def retrieve(self, request: web.Request) -> web.Response:
        record = await self._owned(request)
        return web.json_response(record.api())

    async def content(self, request: web.Request) -> web.StreamResponse:
        record = await self._owned(request)
        chunks = self._store.get(file_key(record.id))
        try:
            first = await anext(chunks, b"")
        except ObjectMissing:
            raise not_found(record.id) from None
        response = web.StreamResponse(
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Disposition": f'attachment; filename="{record.filename}"',
            }
        )
        response.content_length = record.bytes
        await response.prepare(request)
        await response.write(first)
        async for chunk in chunks:
            await response.write(chunk)
        await response.write_eof()
        return response

    async def delete(self, request: web.Request) -> web.Response:
        record = await self._owned(request)
        running = [
            b.id
            for b in self._book.batches_of(record.owner)
            if b.input_file_id == record.id and not b.status.terminal
        ]
        if running:
            raise ApiError(
                400, f"the file is the input of batch {running[0]}, which has not finished: "
                "cancel it first", param="file_id", code="file_in_use",
            )  # fmt: skip
        await self._forget(record)
        return web.json_response({"id": record.id, "object": "file", "deleted": True})

    async def owned_file(self, file_id: str, key: ApiKey) -> FileRecord:
        """The file ``key`` may use, found after a sync if not known yet; 404 otherwise."""
        record = self._book.files.get(file_id) if is_file_id(file_id) else None
        if record is None and is_file_id(file_id) and await self._book.sync():
            record = self._book.files.get(file_id)
        if record is None or record.owner != key.name or not self._live(record):
            raise not_found(file_id)
        return record

    async def _owned(self, request: web.Request) -> FileRecord:
        key = self._authenticate(request)
        return await self.owned_file(request.match_info["file_id"], key)

    def _live(self, record: FileRecord) -> bool:
        """False for an expired file, whose bytes and record are then deleted (not awaited:
        the answer does not wait for the store)."""
        if record.expires_at is None or record.expires_at > self._clock():
            return True
        task = asyncio.create_task(self._forget(record))
        task.add_done_callback(_log_failure)
        return False

    async def _forget(self, record: FileRecord) -> None:
        await self._store.delete(file_key(record.id))
        await self._book.delete_file(record.id)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("deleting an expired file failed: %r", task.exception())


class _Counted:
    """The file part as chunks, counted (bytes, non-blank lines) against the limits."""

    def __init__(self, part: BodyPartReader, settings: BatchSettings) -> None:
        self._part = part
        self._settings = settings
        self._splitter = LineSplitter(max_line_bytes=settings.max_line_bytes, keep_data=False)
        self.size = 0
        self.lines = 0

    async def chunks(self) -> AsyncIterator[bytes]:
        settings = self._settings
        while chunk := await self._part.read_chunk(_CHUNK_BYTES):
            self.size += len(chunk)
            if self.size > settings.max_file_bytes:
                raise _TooLarge(f"the file is larger than {settings.max_file_bytes} bytes")
            self._count(self._splitter.feed(chunk))
            yield chunk
        last = self._splitter.finish()
        self._count([] if last is None else [last])

    def _count(self, lines: list[Line]) -> None:
        self.lines += sum(1 for line in lines if not line.blank)
        if self.lines > self._settings.max_file_lines:
            limit = self._settings.max_file_lines
            raise _TooLarge(f"the file has more than {limit} lines (requests)")


async def _small_field(part: BodyPartReader) -> str:
    data = bytearray()
    while chunk := await part.read_chunk(_FIELD_BYTES):
        data += chunk
        if len(data) > _FIELD_BYTES:
            raise bad_field(str(part.name)[:64], "this form field is too long")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise bad_field(str(part.name)[:64], "form fields are UTF-8 text") from None


def _expiry_s(fields: dict[str, str]) -> int:
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return DEFAULT_EXPIRY_S
    if anchor != "created_at":
        raise bad_field("expires_after.anchor", "expires_after.anchor is 'created_at'")
    return _int_param(seconds, "expires_after.seconds", MIN_EXPIRY_S, MAX_EXPIRY_S, None)


def _int_param(value: str | None, name: str, low: int, high: int, default: int | None) -> int:
    if value is None and default is not None:
        return default
    if value is None or not value.isdigit() or not low <= int(value) <= high:
        raise bad_field(name, f"{name} must be an integer from {low} to {high}")
    return int(value)


def page(objects: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: the objects after the one with id ``after`` (in list order),
    ``limit`` of them, and whether more follow."""
    if after is not None:
        ids = [o["id"] for o in objects]
        if after not in ids:
            raise bad_field("after", f"no object with id '{after[:80]}' to continue after")
        objects = objects[ids.index(after) + 1 :]
    data = objects[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(objects) > limit,
    }


def _refuse(error: ApiError) -> web.Response:
    """An answer to an upload refused part-way: the rest of its body is not read (the
    connection closes after the answer)."""
    response = web.json_response(error.body(), status=error.status)
    response.force_close()
    return response
