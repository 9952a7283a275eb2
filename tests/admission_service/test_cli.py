"""The command-line entries: bad settings fail at start naming the setting, ``produce`` and
``results`` round-trip through a broker, and each refuses bad arguments clearly."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from kvgate.local.embedded_broker import EmbeddedBroker
from kvgate.protocol.records import (
    REPLY_KIND_HEADER,
    REPLY_KIND_TOKENS,
    InferenceResult,
    ResultStatus,
    SourceRef,
    Timings,
    TokenChunk,
    TokenChunks,
    Usage,
)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def kvgate(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "OTEL_"))}
    clean |= {"PYTHONPATH": str(REPO), "OTEL_SDK_DISABLED": "true"} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvgate", *argv],
        env=clean, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def test_admission_service_refuses_invalid_settings_naming_them(tmp_path: Path) -> None:
    config = tmp_path / "admission.yaml"
    config.write_text("kafka:\n  bootstrap_servers: k:9092\n  partitions: 0\nsurprise: 1\n")
    done = kvgate("admission-service", "--config", str(config), env={"KVGATE_ADMIN__PORT": "x"})
    assert done.returncode == 2
    for named in ("kafka.partitions", "surprise", "admin.port"):
        assert named in done.stderr


def test_admission_service_needs_an_executor_token(tmp_path: Path) -> None:
    config = tmp_path / "admission.yaml"
    config.write_text("kafka: {bootstrap_servers: '127.0.0.1:1'}\n")
    done = kvgate("admission-service", "--config", str(config))
    assert done.returncode == 2
    assert "executors.token" in done.stderr


def test_sim_executor_needs_a_token() -> None:
    done = kvgate("sim-executor", "--port", "1")
    assert done.returncode == 2
    assert "no bearer token" in done.stderr


def test_produce_and_results_round_trip(tmp_path: Path) -> None:
    lines = tmp_path / "requests.jsonl"
    lines.write_text(json.dumps({"request_id": "p1", "prompt": [1, 2]}) + "\n\n" + "not json\n")
    with EmbeddedBroker() as broker:
        produced = kvgate("produce", str(lines), "--bootstrap", broker.bootstrap)
        assert produced.returncode == 0, produced.stderr
        assert "produced 2 records to kvgate.requests" in produced.stdout
        # Read them back with `results` pointed at the request topic: keys and bytes intact.
        echoed = kvgate(
            "results", "--bootstrap", broker.bootstrap, "--topic", "kvgate.requests",
            "--from-beginning", "--count", "2", "--timeout-s", "30",
        )  # fmt: skip
        assert echoed.returncode == 0, echoed.stderr
        assert sorted(echoed.stdout.splitlines()) == sorted(
            [json.dumps({"request_id": "p1", "prompt": [1, 2]}), "not json"]
        )
        short = kvgate(
            "results", "--bootstrap", broker.bootstrap, "--topic", "kvgate.requests",
            "--from-beginning", "--count", "5", "--timeout-s", "3",
        )  # fmt: skip
        assert short.returncode == 1
        assert "2 of 5 results before the timeout" in short.stderr


def test_results_prints_each_result_and_token_chunk_once(tmp_path: Path) -> None:
    """Copies happen (a result without transactions, any chunk of a request run again after a
    hand-off): ``results`` prints the first of each identity, ``--keep-copies`` all of them."""
    answer = InferenceResult(
        request_id="a", status=ResultStatus.COMPLETED,
        usage=Usage(prompt_tokens=1, completion_tokens=2), timings=Timings(end_to_end_s=0.1),
        source=SourceRef(topic="kvgate.requests", partition=0, offset=0),
    ).model_dump_json()  # fmt: skip
    chunks = [
        TokenChunk(
            request_id="a", index=i, token_id=5 + i, exit_depth=1, choice=c
        ).model_dump_json()
        for i, c in ((0, 0), (1, 0), (0, 1), (0, 0), (1, 0), (2, 0))  # ran again from token 0
    ]
    lines = tmp_path / "records.jsonl"
    with EmbeddedBroker() as broker:
        for topic, values in (("kvgate.results", [answer, answer, "not json", "not json"]),
                              ("kvgate.tokens", chunks)):  # fmt: skip
            lines.write_text("\n".join(values) + "\n")
            assert kvgate("produce", str(lines), "--bootstrap", broker.bootstrap, "--topic",
                          topic).returncode == 0  # fmt: skip

        def results(*extra: str) -> list[str]:
            done = kvgate("results", "--bootstrap", broker.bootstrap, "--from-beginning",
                          "--timeout-s", "5", *extra)  # fmt: skip
            return done.stdout.splitlines()

        # (Unkeyed values may land on any partition: their order is not the file's.)
        printed = sorted(results())
        assert printed == sorted([answer, "not json", "not json"]), "no id: always printed"
        assert results("--tokens") == [chunks[0], chunks[1], chunks[2], chunks[5]], "by choice"
        assert results("--tokens", "--keep-copies") == chunks


def test_results_prints_a_line_per_chunk_of_a_steps_record() -> None:
    """The service writes a step's chunks for a partition as one record (``TokenChunks``,
    header ``tokens``): ``results --tokens`` prints each chunk as its own line, the first of
    each identity across records; a record that does not parse is printed as it is."""
    chunks = [
        TokenChunk(request_id=rid, index=i, token_id=5 + i, exit_depth=1)
        for rid, i in (("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 1), ("a", 2))
    ]  # the second ("a", 1) is a copy (a re-run after a hand-off)
    steps = [
        TokenChunks(chunks=chunks[:2]), TokenChunks(chunks=chunks[2:4]),
        TokenChunks(chunks=chunks[4:]),
    ]  # fmt: skip
    headers = [(REPLY_KIND_HEADER, REPLY_KIND_TOKENS)]

    async def produce(bootstrap: str) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        try:
            for step in steps:
                value = step.model_dump_json(exclude_none=True).encode()
                await producer.send_and_wait("kvgate.tokens", value, partition=0, headers=headers)
            await producer.send_and_wait(
                "kvgate.tokens", b"{not json", partition=0, headers=headers
            )
        finally:
            await producer.stop()

    with EmbeddedBroker() as broker:
        asyncio.run(produce(broker.bootstrap))
        done = kvgate("results", "--bootstrap", broker.bootstrap, "--from-beginning", "--tokens",
                      "--timeout-s", "5")  # fmt: skip
    lines = done.stdout.splitlines()
    assert lines[-1] == "{not json"
    printed = [TokenChunk.model_validate_json(line) for line in lines[:-1]]
    assert printed == [chunks[i] for i in (0, 1, 2, 3, 5)]


def test_produce_reports_a_missing_file(tmp_path: Path) -> None:
    done = kvgate("produce", str(tmp_path / "absent.jsonl"), "--bootstrap", "127.0.0.1:1")
    assert done.returncode == 2
    assert "No such file" in done.stderr


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again: connecting is refused


@pytest.mark.parametrize("command", ["produce", "results"])
def test_an_unreachable_broker_is_one_line_and_exit_1(tmp_path: Path, command: str) -> None:
    lines = tmp_path / "requests.jsonl"
    lines.write_text(json.dumps({"request_id": "p1", "prompt": [1, 2]}) + "\n")
    bootstrap = f"127.0.0.1:{_closed_port()}"
    args = [str(lines)] if command == "produce" else []
    done = kvgate(command, *args, "--bootstrap", bootstrap)
    assert done.returncode == 1
    assert done.stderr == (
        f"kvgate {command}: cannot reach Kafka at {bootstrap}: no bootstrap server answered\n"
    )


@pytest.mark.parametrize("command", ["produce", "results"])
def test_a_broker_that_never_answers_times_out_at_the_connect_timeout(
    tmp_path: Path, command: str
) -> None:
    lines = tmp_path / "requests.jsonl"
    lines.write_text(json.dumps({"request_id": "p1", "prompt": [1, 2]}) + "\n")
    args = [str(lines)] if command == "produce" else []
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        bootstrap = f"127.0.0.1:{silent.getsockname()[1]}"
        # The request timeout outlasts the process's deadline, so only the connect timeout ends it.
        done = kvgate(
            command, *args, "--bootstrap", bootstrap,
            "--connect-timeout-s", "1", "--request-timeout-s", "600", timeout=60,
        )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr == f"kvgate {command}: Kafka at {bootstrap} did not answer within 1 s\n"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (("--bootstrap", "127.0.0.1:kafka"), "--bootstrap: '127.0.0.1:kafka' is not host:port"),
        (("--bootstrap", "127.0.0.1"), "--bootstrap: '127.0.0.1' is not host:port"),
        (("--bootstrap", "127.0.0.1:1", "--request-timeout-s", "0.5"), "at least 1, got 0.5"),
        (("--bootstrap", "127.0.0.1:1", "--connect-timeout-s", "0"), "must be positive, got 0"),
    ],
)
def test_bad_connection_options_are_one_line_and_exit_2(
    option: tuple[str, ...], message: str
) -> None:
    done = kvgate("results", *option)
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and message in done.stderr, done.stderr


def test_admission_service_refuses_missing_topics_when_it_may_not_create_them(
    tmp_path: Path,
) -> None:
    with EmbeddedBroker() as broker:
        config = tmp_path / "admission.yaml"
        config.write_text(
            f"kafka: {{bootstrap_servers: '{broker.bootstrap}', create_topics: false,"
            " exactly_once: 'off'}\nexecutors: {token: t}\nadmin: {port: 0}\n"
        )
        done = kvgate("admission-service", "--config", str(config))
    assert done.returncode == 2
    assert "do not exist and kafka.create_topics is false" in done.stderr
