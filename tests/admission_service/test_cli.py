"""The command-line entries: bad settings fail at start naming the setting, ``produce`` and
``results`` round-trip through a broker, and each refuses bad arguments clearly."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.local.embedded_broker import EmbeddedBroker

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
