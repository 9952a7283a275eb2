"""Kafka plumbing: topics, the transactions probe, committed offsets
with their metadata, and the results scan that finds requests already answered.

Everything that speaks to Kafka directly, other than the consume loop (``intake.py``) and the
commit cycles (``outbox.py``), lives here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Final

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    IncompatibleBrokerVersion,
    KafkaConnectionError,
    KafkaError,
    UnsupportedVersionError,
)
from aiokafka.structs import ConsumerRecord

from kvgate.admission_service.settings import ExactlyOnce, KafkaSettings
from kvgate.admission_service.validation import RawRecord
from kvgate.kafka_connection import client_options, partition_counts, wait_for_topics

log = logging.getLogger(__name__)


class KafkaSetupError(RuntimeError):
    """Kafka is not usable as configured (topics, partitions, transactions)."""


def raw_record(message: ConsumerRecord[bytes, bytes]) -> RawRecord:
    return RawRecord(
        topic=message.topic,
        partition=message.partition,
        offset=message.offset,
        key=message.key,
        value=message.value,
        headers=tuple(message.headers),
        timestamp_ms=message.timestamp,
    )


# ---------------------------------------------------------------------------------- topics


MAX_MESSAGE_BYTES: Final = "max.message.bytes"


@dataclass(frozen=True, slots=True)
class TopicLimits:
    """What the topics were found to be at start-up: request partitions, and the largest
    record batch (``max.message.bytes``) the request and dead-letter topics accept (None when
    the broker does not say: then only the producer's own limit is known)."""

    request_partitions: int
    request_max_bytes: int | None
    dlq_max_bytes: int | None


# Errors that mean the broker has no DescribeConfigs at all (aiokafka found no version both
# sides speak): nothing is wrong, so the unknown limits are said at INFO, not as a warning.
_NO_DESCRIBE_CONFIGS: Final = (
    IncompatibleBrokerVersion,
    UnsupportedVersionError,
    NotImplementedError,
)


@dataclass(frozen=True, slots=True)
class _Described:
    """``max.message.bytes`` by topic, as far as the broker described it, and why not further
    (the call's error; None when the broker answered, with or without the key)."""

    found: dict[str, int]
    error: Exception | None = None


async def _max_message_bytes(admin: AIOKafkaAdminClient, topics: list[str]) -> _Described:
    """``max.message.bytes`` of each topic, as far as the broker describes them.

    Every config of the topics is asked for (``configs=None``: a null key list) and the one
    wanted picked out. Naming the key would give a shorter answer, but Tansu (the embedded
    broker, 0.6) cannot decode a request that names keys: it logs ``StringWithoutLength`` and
    drops the connection. It answers a null list, with no entries (it keeps no topic
    configs); a real Kafka answers a few dozen entries per topic.
    """
    resources = [ConfigResource(ConfigResourceType.TOPIC, t, None) for t in topics]
    try:
        responses = await admin.describe_configs(resources)
    except (KafkaError, NotImplementedError, ValueError, IndexError, TypeError) as exc:
        return _Described({}, exc)
    found: dict[str, int] = {}
    for response in responses:
        for error_code, _message, _kind, name, entries in (r[:5] for r in response.resources):
            if error_code != 0:
                continue
            for entry in entries:
                if entry[0] == MAX_MESSAGE_BYTES and str(entry[1]).isdigit():
                    found[name] = int(entry[1])
    return _Described(found)


def _say_unknown_limits(described: list[_Described], topics: list[str]) -> None:
    """One line when a topic's record size limit stays unknown: a warning when the call failed,
    INFO when the broker has no such call or keeps no such config (the embedded broker)."""
    unknown = [t for t in topics if not any(t in d.found for d in described)]
    if not unknown:
        return
    errors = [d.error for d in described if d.error is not None]
    failed = [e for e in errors if not isinstance(e, _NO_DESCRIBE_CONFIGS)]
    if failed:
        log.warning("the broker does not describe topic configs (%r)", failed[0])
    elif errors:
        log.info("the broker has no DescribeConfigs (%r): %s unknown", errors[0], MAX_MESSAGE_BYTES)
    else:
        log.info(
            "the broker reports no %s for %s: dead letters are sized by the producer's limit",
            MAX_MESSAGE_BYTES,
            ", ".join(unknown),
        )


async def ensure_topics(settings: KafkaSettings) -> TopicLimits:
    """Create missing topics (when allowed), check co-partitioning, and read the record size
    limits of the request and dead-letter topics.

    Results (and tokens) must have at least as many partitions as requests: the result of a
    request read from partition ``p`` is written to partition ``p``. A dead-letter topic
    created here accepts records as large as the request topic does, so that an oversized
    request's dead letter keeps its original bytes whenever the producer can send them.
    """
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        outputs = [settings.result_topic, settings.dlq_topic, settings.abort_topic]
        if settings.token_topic is not None:
            outputs.append(settings.token_topic)
        wanted = [settings.request_topic, *outputs]
        counts = await partition_counts(admin, wanted)
        missing = [t for t in wanted if t not in counts]
        if missing and not settings.create_topics:
            raise KafkaSetupError(f"topics {missing} do not exist and kafka.create_topics is false")
        requests = counts.get(settings.request_topic, settings.partitions)
        if settings.request_topic in missing:
            await _create(admin, settings, [settings.request_topic], requests, {})
            counts = await _appeared(admin, [settings.request_topic])
            missing.remove(settings.request_topic)
        of_requests = await _max_message_bytes(admin, [settings.request_topic])
        request_limit = of_requests.found.get(settings.request_topic)
        if missing:
            dlq_config = {} if request_limit is None else {MAX_MESSAGE_BYTES: str(request_limit)}
            others = [t for t in missing if t != settings.dlq_topic]
            if settings.dlq_topic in missing:
                await _create(admin, settings, [settings.dlq_topic], requests, dlq_config)
            if others:
                await _create(admin, settings, others, requests, {})
            counts = await _appeared(admin, wanted)
        requests = counts[settings.request_topic]
        for topic in (settings.result_topic, settings.token_topic):
            if topic is not None and counts[topic] < requests:
                raise KafkaSetupError(
                    f"topic {topic} has {counts[topic]} partitions but {settings.request_topic} "
                    f"has {requests}: results are written to the request's partition, so it "
                    "needs at least as many"
                )
        of_dlq = await _max_message_bytes(admin, [settings.dlq_topic])
        dlq_limit = of_dlq.found.get(settings.dlq_topic)
        _say_unknown_limits([of_requests, of_dlq], [settings.request_topic, settings.dlq_topic])
        if request_limit is not None and dlq_limit is not None and dlq_limit < request_limit:
            log.warning(
                "%s accepts records of up to %d bytes but %s only %d: larger dead letters are "
                "truncated (their size, hash and source offset are kept)",
                settings.request_topic,
                request_limit,
                settings.dlq_topic,
                dlq_limit,
            )
        return TopicLimits(requests, request_limit, dlq_limit)
    finally:
        await admin.close()


_TOPIC_ALREADY_EXISTS: Final = 36


async def _create(
    admin: AIOKafkaAdminClient,
    settings: KafkaSettings,
    topics: list[str],
    partitions: int,
    config: dict[str, str],
) -> None:
    """Create ``topics`` (one already there counts as created: another instance was first).
    A broker that refuses ``config`` gets the topics with its defaults (and a warning)."""
    new = [
        NewTopic(topic, partitions, settings.replication_factor, topic_configs=config)
        for topic in topics
    ]
    response = await admin.create_topics(new)
    # aiokafka returns per-topic error codes instead of raising.
    errors = [(t, code, rest) for t, code, *rest in response.topic_errors]
    refused = [
        (t, code, rest) for t, code, rest in errors if code not in (0, _TOPIC_ALREADY_EXISTS)
    ]
    if refused and config:
        log.warning(
            "creating %s with %s failed (%s); using the broker's defaults", topics, config, refused
        )
        await _create(admin, settings, [t for t, _, _ in refused], partitions, {})
    elif refused:
        raise KafkaSetupError(f"creating topics failed: {refused}")
    log.info("created topics %s with %d partitions %s", topics, partitions, config or "")


_TOPICS_APPEAR_S: Final = 30.0


async def _appeared(admin: AIOKafkaAdminClient, topics: list[str]) -> dict[str, int]:
    counts = await wait_for_topics(admin, topics, _TOPICS_APPEAR_S)
    if counts is None:
        raise KafkaSetupError(f"topics {topics} did not appear within {_TOPICS_APPEAR_S:.0f} s")
    return counts


async def supports_transactions(settings: KafkaSettings) -> bool:
    """Whether the broker accepts a transactional producer (Tansu, for one, does not)."""
    producer = AIOKafkaProducer(
        **client_options(settings),
        transactional_id=f"{settings.transactional_prefix}.probe",
        transaction_timeout_ms=settings.transaction_timeout_ms,
    )
    try:
        await producer.start()
    except KafkaConnectionError:
        raise
    except KafkaError as exc:
        log.warning("the broker refused a transactional producer (%r): exactly-once is off", exc)
        return False
    finally:
        await producer.stop()
    return True


async def exactly_once_enabled(settings: KafkaSettings) -> bool:
    if settings.exactly_once is ExactlyOnce.OFF:
        return False
    supported = await supports_transactions(settings)
    if settings.exactly_once is ExactlyOnce.ON and not supported:
        raise KafkaSetupError(
            "kafka.exactly_once is 'on' but the broker does not support transactions; "
            "set it to 'auto' or 'off'"
        )
    return supported


# --------------------------------------------------------------------- offsets and the scan


async def committed_offset(
    consumer: AIOKafkaConsumer, tp: TopicPartition
) -> tuple[int | None, str | None]:
    """The group's committed offset of ``tp`` and its metadata (None, None when none).

    aiokafka's public ``committed()`` drops the metadata, so this asks the group coordinator the
    consumer already holds; brokers that do not keep metadata return an empty string.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is not None:
        found = await coordinator.fetch_committed_offsets([tp])
        entry = found.get(tp)
        if entry is None or entry.offset < 0:
            return None, None
        return int(entry.offset), str(entry.metadata or "")
    offset = await consumer.committed(tp)
    return (None if offset is None or offset < 0 else int(offset)), None


@dataclass(frozen=True, slots=True)
class AnsweredScan:
    """What a results partition says at assignment (see :func:`scan_answered`)."""

    answered: dict[int, int]  # request offset -> results offset, for requests >= committed
    end: int | None  # where the scan ended (None: it gave up)
    ids: list[tuple[str, float]]  # (request id, wall-clock seconds) answered since ids_since


async def _window_start(
    consumer: AIOKafkaConsumer, tp: TopicPartition, since_ms: int
) -> int | None:
    """The first results offset written at or after ``since_ms`` (the end when none is);
    None when the broker cannot say (Tansu: then the caller reads from its own start)."""
    try:
        found = await consumer.offsets_for_times({tp: since_ms})
    except (KafkaError, ValueError, TypeError) as exc:
        log.warning("%s: the broker cannot look offsets up by time (%r)", tp, exc)
        return None
    entry = found.get(tp)
    if entry is not None:
        return int(entry.offset)
    ends = await consumer.end_offsets([tp])
    return int(ends[tp])


async def scan_answered(
    settings: KafkaSettings,
    *,
    partition: int,
    results_from: int | None,
    committed: int | None,
    read_committed: bool,
    ids_since_s: float | None = None,
) -> AnsweredScan:
    """Read results partition ``partition`` to its end, from the earlier of ``results_from``
    (its start when None) and the first result written since ``ids_since_s``; returns the
    answers to requests at or above ``committed`` (request offset -> results offset), the end
    position reached (None if the scan gave up), and the ids answered since ``ids_since_s``.

    The end is the last stable offset (transactions) or high watermark as the broker reports
    them with each fetch — both correct on brokers whose ``end_offsets`` are not (Tansu).
    """
    tp = TopicPartition(settings.result_topic, partition)
    consumer = AIOKafkaConsumer(
        **client_options(settings),
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed" if read_committed else "read_uncommitted",
        auto_offset_reset="earliest",
    )
    await consumer.start()
    answered: dict[int, int] = {}
    ids: list[tuple[str, float]] = []
    since_ms = None if ids_since_s is None else int(ids_since_s * 1000)
    try:
        consumer.assign([tp])
        start = results_from
        if start is not None and since_ms is not None:
            window = await _window_start(consumer, tp, since_ms)
            start = None if window is None else min(start, window)
        if start is None:
            await consumer.seek_to_beginning(tp)
        else:
            consumer.seek(tp, start)
        deadline = time.monotonic() + settings.skip_scan_timeout_s
        while True:
            batch = await consumer.getmany(tp, timeout_ms=200, max_records=5000)
            for message in batch.get(tp, []):
                found = _answered_offset(message.value, settings.request_topic, partition)
                if found is not None and (committed is None or found >= committed):
                    answered[found] = message.offset
                if since_ms is not None and message.timestamp >= since_ms and message.key:
                    with contextlib.suppress(UnicodeDecodeError):
                        ids.append((message.key.decode("utf-8"), message.timestamp / 1000))
            end = consumer.last_stable_offset(tp) if read_committed else consumer.highwater(tp)
            position = await consumer.position(tp)
            if end is not None and position >= end and not batch:
                return AnsweredScan(answered, position, ids)
            if time.monotonic() > deadline:
                log.error(
                    "reading %s for answered requests gave up after %.0f s at offset %d",
                    tp,
                    settings.skip_scan_timeout_s,
                    position,
                )
                return AnsweredScan(answered, None, ids)
    finally:
        await consumer.stop()


def _answered_offset(value: bytes | None, topic: str, partition: int) -> int | None:
    """The request offset a result record answers, if it answers ``topic``/``partition``."""
    if value is None:
        return None
    try:
        source = json.loads(value).get("source") or {}
    except (ValueError, AttributeError):
        return None
    if source.get("topic") != topic or source.get("partition") != partition:
        return None
    offset = source.get("offset")
    return offset if isinstance(offset, int) else None
