"""Whether Kafka answers: a metadata request every so often, on a client of its own.

The consume loop and the commit cycles never surface a broker outage: aiokafka retries under
them, a paused broker just makes requests hang, and an idle service sends nothing at all. So
the service asks the cluster for its metadata about every ``kafka.health_check_interval_s``; a
check that fails or is unanswered after ``kafka.health_check_timeout_s`` marks Kafka unreachable
until one succeeds again::

    reachable ──check fails or times out──▶ unreachable since t0 (outage counted, logged once)
        ▲                                        │
        └──────────────check succeeds────────────┘ (logged with the outage's length)

The pause before the next check is the shared retry delay (``kvgate/backoff.py``) with the
interval as its first step and the number of consecutive failed checks as the retry count:
``[interval/2, interval]`` while Kafka answers, doubling per failed check up to
``OUTAGE_BACKOFF_FACTOR`` intervals. Every admission service of a cluster (one per pool) polls
the same brokers: the jitter keeps services started together from checking in step, and the
backoff keeps a broker that is down, or coming back, from being met by a new connection from
each of them every interval. An outage's end is still seen within ``OUTAGE_BACKOFF_FACTOR``
intervals (8 s at the default 2 s).

Readiness reports the outage (``/readyz`` 503 with the reason); liveness does not, because
restarting the service cannot bring a broker back and would throw away the work in flight,
which resumes by itself once Kafka answers. The client is separate from the consumer's and the
producers' so that a check never queues behind (or disturbs) their requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable

from aiokafka.client import AIOKafkaClient

from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.admission_service.settings import KafkaSettings
from kvgate.backoff import Uniform, jittered_delay_s
from kvgate.kafka_connection import client_options

log = logging.getLogger(__name__)

# The longest pause between checks during an outage, in health-check intervals.
OUTAGE_BACKOFF_FACTOR = 4.0


class KafkaHealth:
    def __init__(
        self,
        settings: KafkaSettings,
        metrics: ServiceMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        uniform: Uniform = random.uniform,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self._uniform = uniform
        self._client: AIOKafkaClient | None = None
        self._down_since: float | None = None
        self._last_error = ""
        self._failed_checks = 0  # consecutive, since the last check Kafka answered

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
        try:
            while True:
                await self.check()
                await asyncio.sleep(self.next_delay_s())
        finally:
            await self._close()

    def next_delay_s(self) -> float:
        """The pause before the next check (see the module docstring)."""
        interval = self._settings.health_check_interval_s
        return jittered_delay_s(
            self._failed_checks,
            initial_s=interval,
            max_s=interval * OUTAGE_BACKOFF_FACTOR,
            uniform=self._uniform,
        )

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
        self._failed_checks += 1
        if self._down_since is None:
            self._down_since = self._clock()
            self._metrics.kafka_outages.inc()
            log.warning("kafka is unreachable: %s", reason)

    def _answered(self) -> None:
        if self._down_since is not None:
            log.info("kafka answers again after %.1f s", self._clock() - self._down_since)
        self._down_since = None
        self._last_error = ""
        self._failed_checks = 0

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()
