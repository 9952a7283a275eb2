"""Whether Kafka answers: a metadata request at a fixed interval, on a client of its own.

The consume loop and the commit cycles never surface a broker outage: aiokafka retries under
them, a paused broker just makes requests hang, and an idle service sends nothing at all. So
the service asks the cluster for its metadata every ``kafka.health_check_interval_s``; a check
that fails or is unanswered after ``kafka.health_check_timeout_s`` marks Kafka unreachable until
one succeeds again::

    reachable ──check fails or times out──▶ unreachable since t0 (outage counted, logged once)
        ▲                                        │
        └──────────────check succeeds────────────┘ (logged with the outage's length)

Readiness reports the outage (``/readyz`` 503 with the reason); liveness does not, because
restarting the service cannot bring a broker back and would throw away the work in flight,
which resumes by itself once Kafka answers. The client is separate from the consumer's and the
producers' so that a check never queues behind (or disturbs) their requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from aiokafka.client import AIOKafkaClient

from kvgate.admission_service.kafka_io import client_options
from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.admission_service.settings import KafkaSettings

log = logging.getLogger(__name__)


class KafkaHealth:
    def __init__(
        self,
        settings: KafkaSettings,
        metrics: ServiceMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self._client: AIOKafkaClient | None = None
        self._down_since: float | None = None
        self._last_error = ""

    @property
    def reachable(self) -> bool:
        return self._down_since is None

    def outage(self) -> str | None:
        """Why Kafka counts as unreachable (None while it answers)."""
        if self._down_since is None:
            return None
        seconds = self._clock() - self._down_since
        return f"kafka unreachable for {seconds:.1f} s: {self._last_error}"

    async def run(self) -> None:
        """Check forever (cancel to stop); never raises."""
        interval = self._settings.health_check_interval_s
        try:
            while True:
                await self.check()
                await asyncio.sleep(interval)
        finally:
            await self._close()

    async def check(self) -> bool:
        """One metadata request; updates the state and returns whether Kafka answered."""
        timeout = self._settings.health_check_timeout_s
        try:
            await asyncio.wait_for(self._fetch_metadata(), timeout)
        except TimeoutError:
            self._failed(f"no metadata answer within {timeout:g} s")
            await self._close()  # a hung connection is not reused by the next check
            return False
        except Exception as exc:  # any failure of the check is an outage, never a crash
            self._failed(str(exc) or type(exc).__name__)
            await self._close()
            return False
        self._answered()
        return True

    async def _fetch_metadata(self) -> None:
        if self._client is None:
            options = client_options(self._settings)
            options["client_id"] = f"{self._settings.client_id}-health"
            client = AIOKafkaClient(**options)
            self._client = client
            await client.bootstrap()
        await self._client.fetch_all_metadata()

    def _failed(self, reason: str) -> None:
        self._last_error = reason
        if self._down_since is None:
            self._down_since = self._clock()
            self._metrics.kafka_outages.inc()
            log.warning("kafka is unreachable: %s", reason)

    def _answered(self) -> None:
        if self._down_since is not None:
            log.info("kafka answers again after %.1f s", self._clock() - self._down_since)
        self._down_since = None
        self._last_error = ""

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()
