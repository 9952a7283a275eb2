"""Small Kafka client helpers for the harness: readiness, topic creation, unique names.

The synchronous helpers run their coroutine on a private event loop in a worker thread, so the
same call works from a session fixture, a sync test, or inside an async test's running loop
(where ``asyncio.run`` would refuse). An async test that must keep its own loop turning while
it waits can wrap them in ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol, TypeVar

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from tests.harness.system import HarnessError, port_accepts

T = TypeVar("T")

_ATTEMPT_TIMEOUT_S = 5.0
_TOPIC_NAME_LIMIT = 200  # Kafka allows 249; room for a prefix


class TopicFactory(Protocol):
    """Creates a fresh, uniquely named topic and returns its name (the conftest fixture)."""

    def __call__(
        self, *, partitions: int = 1, configs: Mapping[str, str] | None = None, label: str = ""
    ) -> str: ...


def run_async(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``factory()`` to completion on a fresh event loop in a worker thread."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


async def describe_cluster(bootstrap: str, timeout_s: float = _ATTEMPT_TIMEOUT_S) -> int:
    """One metadata round trip; returns the number of brokers the cluster reports."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000)
    )
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            cluster = await admin.describe_cluster()
    finally:
        await admin.close()
    return len(cluster["brokers"])


def wait_for_broker(
    bootstrap: str,
    *,
    timeout_s: float,
    still_starting: Callable[[], str | None] = lambda: None,
) -> float:
    """Poll metadata until the broker answers; returns the seconds it took.

    ``still_starting`` is asked between attempts; a string it returns is a reason to stop
    waiting (e.g. "the container exited") and becomes the error message.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    last_error = "no attempt finished"
    while time.monotonic() < deadline:
        error = _probe_once(bootstrap)
        if error is None:
            return time.monotonic() - started
        last_error = error
        reason = still_starting()
        if reason is not None:
            raise HarnessError(f"Kafka at {bootstrap} will not become ready: {reason}")
        time.sleep(0.25)
    raise HarnessError(
        f"Kafka at {bootstrap} did not answer a metadata request within {timeout_s:.0f} s "
        f"(last error: {last_error})"
    )


def _probe_once(bootstrap: str) -> str | None:
    """None when the broker answered metadata with at least one broker, else what failed."""
    # A plain TCP connect first keeps aiokafka from logging a refused connection per try.
    if not _any_listener(bootstrap):
        return "nothing listens at the bootstrap address yet"
    try:
        brokers = run_async(lambda: describe_cluster(bootstrap))
    except (KafkaError, OSError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if brokers >= 1 else "metadata listed no brokers"


def _any_listener(bootstrap: str) -> bool:
    for entry in bootstrap.split(","):
        host, _, port = entry.strip().rpartition(":")
        if port.isdigit() and port_accepts(host.strip("[]"), int(port)):
            return True
    return False


def unique_topic_name(label: str) -> str:
    """A topic name that no other test or session uses: ``<label>-<8 hex>``, Kafka-legal."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.") or "topic"
    return f"{cleaned[:_TOPIC_NAME_LIMIT]}-{uuid.uuid4().hex[:8]}"


async def create_topic_async(
    bootstrap: str,
    name: str,
    *,
    partitions: int = 1,
    configs: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
) -> None:
    """Create ``name`` and return once metadata shows a leader for every partition."""
    if partitions < 1:
        raise ValueError(f"partitions must be at least 1, got {partitions}")
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            response = await admin.create_topics(
                [NewTopic(name, partitions, 1, topic_configs=dict(configs or {}))]
            )
            # aiokafka returns per-topic error codes instead of raising.
            for topic, error_code, *rest in response.topic_errors:
                if error_code != 0:
                    message = rest[0] if rest else ""
                    raise HarnessError(
                        f"creating topic {topic} failed: error {error_code} {message}"
                    )
            # Polling: the broker offers no notification when leaders are elected.
            while not await _all_partitions_led(admin, name, partitions):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        await admin.close()


async def _all_partitions_led(admin: AIOKafkaAdminClient, name: str, partitions: int) -> bool:
    (topic,) = await admin.describe_topics([name])
    led = [p for p in topic["partitions"] if p["leader"] >= 0 and p["error_code"] == 0]
    return topic["error_code"] == 0 and len(led) == partitions


def create_topic(
    bootstrap: str,
    name: str,
    *,
    partitions: int = 1,
    configs: Mapping[str, str] | None = None,
) -> None:
    """Synchronous :func:`create_topic_async` (usable from sync and async tests alike)."""
    run_async(lambda: create_topic_async(bootstrap, name, partitions=partitions, configs=configs))


async def delete_topics_async(bootstrap: str, names: list[str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        await admin.delete_topics(names)
    finally:
        await admin.close()
