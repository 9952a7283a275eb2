"""The gateway's batch side: the store, the view of the batch topics, the files and batches
routes, and — unless the feeder runs as its own Deployment (``batches.feeder: false``) — a batch
feeder in this process. ``Gateway`` starts it after its Kafka bridge and stops it before.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from kvgate.admission_service.tokenizer import TextCodec
from kvgate.batch.book import BatchBook
from kvgate.batch.feeder import BatchFeeder
from kvgate.batch.settings import BatchSettings
from kvgate.batch.store import open_store
from kvgate.gateway.batches_api import BatchesApi
from kvgate.gateway.files_api import Authenticate, FilesApi, RateLimit
from kvgate.gateway.settings import GatewaySettings
from kvgate.kafka_connection import client_options


class GatewayBatches:
    def __init__(
        self,
        settings: GatewaySettings,
        batches: BatchSettings,
        codecs: Mapping[str, TextCodec | None],
        authenticate: Authenticate,
        rate_limit: RateLimit,
    ) -> None:
        self._kafka = settings.kafka
        self.store = open_store(batches.store)
        self.book = BatchBook(batches)
        self.files = FilesApi(self.book, self.store, batches, authenticate, rate_limit)
        self.batches = BatchesApi(
            self.book, self.files, batches, settings, authenticate, rate_limit
        )
        self.feeder: BatchFeeder | None = None
        if batches.feeder:
            self.feeder = BatchFeeder(
                kafka=settings.kafka, settings=batches, routes=settings.models, codecs=codecs,
                abort_topic=settings.abort_topic, default_max_tokens=settings.default_max_tokens,
                store=self.store,
            )  # fmt: skip

    def routes(self) -> list[web.RouteDef]:
        return [*self.files.routes(), *self.batches.routes()]

    @property
    def ready(self) -> bool:
        feeding = self.feeder is None or self.feeder.failure is None
        return self.book.ready.is_set() and self.book.failure is None and feeding

    async def start(self) -> None:
        await self.book.start(client_options(self._kafka))
        if self.feeder is not None:
            await self.feeder.start()

    async def close(self) -> None:
        if self.feeder is not None:
            await self.feeder.close()
        await self.book.close()
        await self.store.close()
