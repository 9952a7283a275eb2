"""``/v1/batches``: create, retrieve, list (cursor pages), cancel — OpenAI's batch objects,
scoped to the API key that created them.

Creating a batch writes its record (status ``validating``) to its partition of
``kvgate.batches``; the feeder that owns the partition takes it from there (``kvgate.batch.
feeder``). A cancel is a record of its own (``cancel/<id>``), durable the moment it is
acknowledged: the batch shows ``cancelling`` at once, and its owner — now, or whichever feeder
owns it next — aborts what is in flight and finalizes the files.

A batch's lines run at the batch class (``batches.priority``), or at the key's
``min_priority`` when that is less important: a key cannot use a batch to jump its own limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Final, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from kvgate.batch.book import BatchBook
from kvgate.batch.ids import is_batch_id, new_batch_id
from kvgate.batch.journal import BatchRecord, CancelRecord
from kvgate.batch.objects import BatchStatus, Endpoint, FilePurpose, Metadata
from kvgate.batch.settings import COMPLETION_WINDOW_S, BatchSettings
from kvgate.gateway.files_api import Authenticate, FilesApi, RateLimit, page
from kvgate.gateway.http_input import json_body
from kvgate.gateway.openai_api import ApiError, bad_field, parse_body
from kvgate.gateway.settings import ApiKey, GatewaySettings

_LIST_LIMIT: Final = 100
_LIST_DEFAULT: Final = 20


class _OutputExpiry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=3600, le=30 * 86_400)]


class CreateBatch(BaseModel):
    """POST /v1/batches."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input_file_id: Annotated[str, Field(min_length=1, max_length=128)]
    endpoint: Endpoint
    completion_window: Literal["24h"]
    metadata: Metadata | None = None
    output_expires_after: _OutputExpiry | None = None


def not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"no batch with id '{batch_id[:80]}'", param="batch_id", code="not_found")


class BatchesApi:
    def __init__(
        self,
        book: BatchBook,
        files: FilesApi,
        settings: BatchSettings,
        gateway: GatewaySettings,
        authenticate: Authenticate,
        rate_limit: RateLimit,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._book = book
        self._files = files
        self._settings = settings
        self._gateway = gateway
        self._authenticate = authenticate
        self._rate_limit = rate_limit
        self._clock = clock

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/batches", self.create),
            web.get("/v1/batches", self.list_batches),
            web.get("/v1/batches/{batch_id}", self.retrieve),
            web.post("/v1/batches/{batch_id}/cancel", self.cancel),
        ]

    async def create(self, request: web.Request) -> web.Response:
        key = self._authenticate(request)
        self._rate_limit(key)
        body = parse_body(CreateBatch, await json_body(request, self._gateway))
        source = await self._files.owned_file(body.input_file_id, key)
        if source.purpose is not FilePurpose.BATCH:
            raise bad_field("input_file_id", "the input file must have purpose 'batch'")
        now = int(self._clock())
        record = BatchRecord(
            id=new_batch_id(), owner=key.name, endpoint=body.endpoint,
            input_file_id=source.id, completion_window=body.completion_window,
            metadata=body.metadata, priority=max(self._settings.priority, key.min_priority),
            output_expires_after_s=(
                None if body.output_expires_after is None else body.output_expires_after.seconds
            ),
            status=BatchStatus.VALIDATING, created_at=now,
            expires_at=now + COMPLETION_WINDOW_S[body.completion_window],
        )  # fmt: skip
        await self._book.create_batch(record)
        return web.json_response(record.api())

    async def retrieve(self, request: web.Request) -> web.Response:
        record = await self._owned(request)
        return web.json_response(record.api(self._book.cancel_of(record.id)))

    async def list_batches(self, request: web.Request) -> web.Response:
        key = self._authenticate(request)
        raw = request.query.get("limit")
        if raw is not None and not (raw.isdigit() and 1 <= int(raw) <= _LIST_LIMIT):
            raise bad_field("limit", f"limit must be an integer from 1 to {_LIST_LIMIT}")
        limit = int(raw) if raw is not None else _LIST_DEFAULT
        objects = [b.api(self._book.cancel_of(b.id)) for b in self._book.batches_of(key.name)]
        return web.json_response(page(objects, request.query.get("after"), limit))

    async def cancel(self, request: web.Request) -> web.Response:
        record = await self._owned(request)
        self._rate_limit(self._authenticate(request))
        cancel = self._book.cancel_of(record.id)
        if cancel is None and record.status.terminal:
            raise ApiError(
                400, f"the batch is {record.status.value}: there is nothing to cancel",
                param="batch_id", code="batch_not_cancellable",
            )  # fmt: skip
        if cancel is None:
            cancel = CancelRecord(batch_id=record.id, requested_at=int(self._clock()))
            await self._book.cancel_batch(cancel)
        return web.json_response(record.api(cancel))

    async def _owned(self, request: web.Request) -> BatchRecord:
        key = self._authenticate(request)
        return await self._batch(request.match_info["batch_id"], key)

    async def _batch(self, batch_id: str, key: ApiKey) -> BatchRecord:
        if not is_batch_id(batch_id):
            raise not_found(batch_id)
        record = self._book.batch(batch_id)
        if record is None and await self._book.sync():
            record = self._book.batch(batch_id)
        if record is None or record.owner != key.name:
            raise not_found(batch_id)
        return record
