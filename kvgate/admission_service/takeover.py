"""Taking request partitions over after an assignment, off the rebalance callback.

Why off the callback: aiokafka sends no heartbeat while ``on_partitions_assigned`` runs — its
heartbeat task starts only once the join, callback included, has completed. Taking one
partition over costs about 0.63 s on a new exactly-once group (its transactional producer's
first InitProducerId, the committed offset, the results scan), so a callback that took 16
partitions over one after another ran for 10 s and outlived a 6 s session: the member was
expelled the moment it returned, handed everything off and took it back (the work in flight ran
twice). The callback now only pauses what it was given and starts the take-over as a task; the
heartbeat goes on meanwhile, whatever the take-over costs.

Taking partition ``p`` over (in this order): start ``p``'s transactional producer (fences the
previous owner, finishing or aborting its open transaction); read the committed offset and its
metadata; scan the results partition ``p`` from the recorded position (or from the start of the
idempotency window, when earlier) for answers to requests at or above that offset and for the
ids answered within the window (``idempotency.py``); track ``p``'s ledger; seek to the offset;
then ``on_ready(p)``.

Invariants:

- ``p`` is fetched only once it is taken over: the callback pauses every assigned partition,
  and only ``on_ready(p)`` may resume ``p`` (intake keeps the set of partitions it may resume).
- The partitions of one assignment are taken over concurrently, at most ``MAX_CONCURRENT`` at
  a time (each holds a producer and a scan consumer with their connections), so the time to
  read again is about one partition's, not the sum.
- A revocation waits for take-overs still running (``settle``) before it closes partitions, so
  ``close_partition(p)`` never races ``open_partition(p)``. Rebalances are eager — every
  assignment is preceded by the revocation of everything — and aiokafka keeps heartbeating
  while ``on_partitions_revoked`` runs, so waiting there costs the rebalance time, never the
  membership.
- A failed take-over fails the service (``on_failure``): a partition held but never read
  would stall its requests for as long as the group kept it here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition

from kvgate.admission_service.idempotency import AnsweredIds
from kvgate.admission_service.kafka_io import committed_offset, scan_answered
from kvgate.admission_service.offsets import PartitionLedger, decode_metadata
from kvgate.admission_service.outbox import Outbox
from kvgate.admission_service.settings import IsolationLevel, ServiceSettings

log = logging.getLogger(__name__)

# Partitions taken over at once: enough that a pool's usual 6-64 partitions take about one
# partition's time; few enough that a 1000-partition assignment does not open 2000 connections.
MAX_CONCURRENT = 32


class TakeOvers:
    """The take-overs of the current assignment; ``taken_over_once`` is set when the first
    assignment has been taken over whole."""

    def __init__(
        self,
        settings: ServiceSettings,
        consumer: AIOKafkaConsumer,
        outbox: Outbox,
        answered: AnsweredIds,
        *,
        on_ready: Callable[[TopicPartition], None],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self.settings = settings
        self.consumer = consumer
        self.outbox = outbox
        self._answered = answered
        self._on_ready = on_ready
        self._on_failure = on_failure
        self._running: set[asyncio.Task[None]] = set()
        self.taken_over_once = asyncio.Event()

    def start(self, assigned: set[TopicPartition]) -> None:
        """Take ``assigned`` over in a task of its own (the caller has paused them)."""
        task = asyncio.create_task(self._take_over_all(assigned), name="kvgate-take-over")
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def settle(self) -> None:
        """Return once no take-over runs (a failed one has already failed the service)."""
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    async def _take_over_all(self, assigned: set[TopicPartition]) -> None:
        began = time.monotonic()
        gate = asyncio.Semaphore(MAX_CONCURRENT)

        async def one(tp: TopicPartition) -> None:
            async with gate:
                await self._take_over(tp)
            self._on_ready(tp)

        # Every take-over ends before this one does (none left running behind a failure).
        outcomes = await asyncio.gather(
            *(one(tp) for tp in sorted(assigned)), return_exceptions=True
        )
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            # A partition we hold but cannot track would never be read: the service must fail
            # (and be restarted) instead.
            log.error("taking over partitions %s failed", sorted(assigned), exc_info=failures[0])
            self._on_failure(failures[0])
            return
        log.info("took %d partitions over in %.2f s", len(assigned), time.monotonic() - began)
        self.taken_over_once.set()

    async def _take_over(self, tp: TopicPartition) -> None:
        kafka = self.settings.kafka
        read_committed = (
            self.outbox.transactional or kafka.isolation_level is IsolationLevel.READ_COMMITTED
        )
        await self.outbox.open_partition(tp.partition)
        committed, metadata = await committed_offset(self.consumer, tp)
        window_s = self.settings.limits.idempotency_window_s
        scan = await scan_answered(
            kafka,
            partition=tp.partition,
            results_from=decode_metadata(metadata),
            committed=committed,
            read_committed=read_committed,
            ids_since_s=time.time() - window_s,
        )
        self._answered.add_all(scan.ids)
        self.outbox.track(
            tp.partition,
            PartitionLedger(committed=committed, answered=scan.answered, results_end=scan.end),
        )
        if committed is not None:
            self.consumer.seek(tp, committed)
        log.info(
            "partition %d assigned at offset %s (%d answered above it found)",
            tp.partition,
            committed,
            len(scan.answered),
        )
