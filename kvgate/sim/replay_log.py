"""Read a window of the request topic as it arrived: every partition, from a position to another.

A position is an offset (``1200``: that offset on every partition; ``0:1200,3:77``: per
partition, the others from their start) or a time (ISO 8601, ``2026-12-01T22:10:00Z``; a time
without a zone is UTC): the first record at or after it, found with ``offsets_for_times``.
``--from`` is inclusive and ``--to`` exclusive; without ``--to`` the window ends at the end
offsets read when the replay starts, so a replay of a live topic terminates.

The consumer is assigned the partitions (no group, nothing committed): replaying never moves the
service's offsets.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from aiokafka import AIOKafkaConsumer, TopicPartition

from kvgate.admission_service.kafka_io import raw_record
from kvgate.admission_service.settings import KafkaSettings
from kvgate.admission_service.validation import RawRecord
from kvgate.kafka_connection import client_options

_FETCH_TIMEOUT_MS: Final = 1000
_MAX_EMPTY_FETCHES: Final = 30  # about 30 s without a record or a position change: give up


class LogPositionError(ValueError):
    """A ``--from``/``--to`` value that is neither an offset nor a time."""


@dataclass(frozen=True, slots=True)
class OffsetPosition:
    """An offset for every partition, or per partition (absent partitions: their start/end)."""

    every: int | None = None
    per_partition: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class TimePosition:
    unix_ms: int


LogPosition = OffsetPosition | TimePosition


def parse_position(text: str) -> LogPosition:
    value = text.strip()
    if value.isdigit():
        return OffsetPosition(every=int(value))
    if ":" in value and all(_is_partition_offset(part) for part in value.split(",")):
        pairs = tuple((int(p), int(o)) for p, o in (part.split(":") for part in value.split(",")))
        if len({p for p, _ in pairs}) != len(pairs):
            raise LogPositionError(f"{text!r}: a partition is named twice")
        return OffsetPosition(per_partition=pairs)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise LogPositionError(
            f"{text!r} is neither an offset (1200, or partition:offset pairs 0:1200,1:40) nor "
            "an ISO 8601 time (2026-12-01T22:10:00Z)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return TimePosition(int(moment.timestamp() * 1000))


def _is_partition_offset(part: str) -> bool:
    partition, sep, offset = part.partition(":")
    return bool(sep) and partition.isdigit() and offset.isdigit()


@dataclass(frozen=True, slots=True)
class LogWindow:
    topic: str
    records: list[RawRecord]  # in (partition, offset) order
    bounds: dict[int, tuple[int, int]]  # partition -> [first, end) offsets read


async def read_window(
    settings: KafkaSettings, topic: str, start: LogPosition, end: LogPosition | None
) -> LogWindow:
    consumer = AIOKafkaConsumer(
        **client_options(settings),
        enable_auto_commit=False,
        isolation_level=settings.isolation_level.value,
        group_id=None,
    )
    try:
        await consumer.start()
        partitions = await _partitions(consumer, topic)
        consumer.assign(partitions)
        begin = await consumer.beginning_offsets(partitions)
        last = await consumer.end_offsets(partitions)
        first = await _resolve(consumer, start, begin, last)
        stop = last if end is None else await _resolve(consumer, end, last, last)
        bounds = {
            tp.partition: (first[tp], max(first[tp], min(stop[tp], last[tp]))) for tp in partitions
        }
        records = await _fetch(consumer, partitions, bounds)
    finally:
        await consumer.stop()
    return LogWindow(topic, records, bounds)


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    # One metadata request for the whole cluster (aiokafka's public calls read a cache that an
    # assigned, unsubscribed consumer never fills).
    cluster = await consumer._client.fetch_all_metadata()
    found = cluster.partitions_for_topic(topic)
    if not found:
        raise LogPositionError(f"topic {topic!r} does not exist on this cluster")
    return [TopicPartition(topic, p) for p in sorted(found)]


async def _resolve(
    consumer: AIOKafkaConsumer,
    position: LogPosition,
    default: dict[TopicPartition, int],
    last: dict[TopicPartition, int],
) -> dict[TopicPartition, int]:
    """Offsets for ``position``, clamped to what each partition holds."""
    if isinstance(position, TimePosition):
        found = await consumer.offsets_for_times(dict.fromkeys(default, position.unix_ms))
        # No record at or after the time: the partition's end.
        resolved = {tp: (last[tp] if hit is None else hit.offset) for tp, hit in found.items()}
    else:
        named = dict(position.per_partition)
        unknown = set(named) - {tp.partition for tp in default}
        if unknown:
            raise LogPositionError(f"partition(s) {sorted(unknown)} do not exist on the topic")
        resolved = {}
        for tp, fallback in default.items():
            offset = position.every if position.every is not None else named.get(tp.partition)
            resolved[tp] = fallback if offset is None else offset
    return {tp: min(max(offset, 0), last[tp]) for tp, offset in resolved.items()}


async def _fetch(
    consumer: AIOKafkaConsumer,
    partitions: list[TopicPartition],
    bounds: dict[int, tuple[int, int]],
) -> list[RawRecord]:
    wanted = [tp for tp in partitions if bounds[tp.partition][0] < bounds[tp.partition][1]]
    for tp in wanted:
        consumer.seek(tp, bounds[tp.partition][0])
    records: list[RawRecord] = []
    open_partitions = set(wanted)
    empty_fetches = 0
    while open_partitions:
        batch = await consumer.getmany(*open_partitions, timeout_ms=_FETCH_TIMEOUT_MS)
        empty_fetches = 0 if batch else empty_fetches + 1
        if empty_fetches > _MAX_EMPTY_FETCHES:
            behind = {tp.partition: await consumer.position(tp) for tp in open_partitions}
            raise LogPositionError(
                f"no records arrive from partition positions {behind} before the window's end "
                f"{ {p: bounds[p][1] for p in behind} }"
            )
        for tp, messages in batch.items():
            _, stop = bounds[tp.partition]
            records.extend(raw_record(m) for m in messages if m.offset < stop)
            # Transaction markers and aborted records take offsets too: the position, not the
            # last record read, says when the window is done.
            if await consumer.position(tp) >= stop:
                open_partitions.discard(tp)
                consumer.pause(tp)
        if not batch:
            for tp in list(open_partitions):
                if await consumer.position(tp) >= bounds[tp.partition][1]:
                    open_partitions.discard(tp)
    records.sort(key=lambda r: (r.partition, r.offset))
    return records


def read_window_sync(
    settings: KafkaSettings, topic: str, start: LogPosition, end: LogPosition | None
) -> LogWindow:
    return asyncio.run(read_window(settings, topic, start, end))
