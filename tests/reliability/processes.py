"""Real processes of the reliability stack, on top of ``tests/integration/admission_stack.py``:
``kvgate executor`` servers with a tiny checkpoint, Prometheus scrapes, resident memory.

Everything waits by polling with a deadline; a process that dies while being waited for fails
the wait with the tail of its log.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from pydantic import TypeAdapter

from kvgate.protocol import step as wire
from tests.integration.admission_stack import (
    EXECUTOR_TOKEN,
    Process,
    free_port,
    spawn,
    wait_http,
)

_SERVER_MESSAGE: TypeAdapter[wire.SessionAccepted | wire.StepResult | wire.ProtocolError] = (
    TypeAdapter(wire.ServerMessage)
)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> metric name (with its labels, as written) -> value."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            samples[head] = float(value)
    return samples


def metric_sum(samples: dict[str, float], name: str) -> float:
    """The sum of every sample of ``name`` over all its label sets."""
    return sum(v for head, v in samples.items() if head.split("{", 1)[0] == name)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return parse_metrics(response.read().decode())


@dataclass
class RealExecutor:
    """A ``kvgate executor`` process serving a checkpoint on the CPU."""

    process: Process
    port: int
    argv: list[str]

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def endpoint(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/steps"

    def metrics(self) -> dict[str, float]:
        return scrape(f"http://127.0.0.1:{self.port}/metrics")


def token_file(log_dir: Path) -> Path:
    path = log_dir / "executor-token"
    path.write_text(EXECUTOR_TOKEN)
    return path


def spawn_real_executor(
    log_dir: Path,
    name: str,
    model_dir: Path,
    *,
    num_blocks: int,
    block_size: int,
    host_snapshot_blocks: int = 0,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> RealExecutor:
    """Start ``kvgate executor`` (not waiting for it: see :func:`wait_executor_ready`);
    ``env`` adds variables (``OTEL_*``, say) to the process's environment."""
    port = port or free_port()
    argv = [
        "executor", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--num-blocks", str(num_blocks), "--block-size", str(block_size),
        "--host-snapshot-blocks", str(host_snapshot_blocks), "--executor-id", name,
        "--token-file", str(token_file(log_dir)), "--no-calibrate",
    ]  # fmt: skip
    # One intra-op thread: on two shared cores, torch's extra threads only wait for each other.
    process = spawn(name, argv, log_dir, {"OMP_NUM_THREADS": "1", **(env or {})})
    return RealExecutor(process, port, argv)


def wait_executor_ready(executor: RealExecutor, timeout_s: float = 120.0) -> None:
    wait_http(executor.process, f"http://127.0.0.1:{executor.port}/readyz", timeout_s=timeout_s)


def restart_real_executor(log_dir: Path, executor: RealExecutor) -> RealExecutor:
    """The same command again (same port, same name): a fresh process that knows no epoch."""
    process = spawn(executor.name, executor.argv, log_dir, {"OMP_NUM_THREADS": "1"})
    restarted = RealExecutor(process, executor.port, executor.argv)
    wait_executor_ready(restarted)
    return restarted


def rss_bytes(process: Process) -> int:
    return int(psutil.Process(process.popen.pid).memory_info().rss)


def poll(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Block until ``condition()`` holds (tests call it through ``asyncio.to_thread``)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


@dataclass(frozen=True)
class Opening:
    """How an executor answered a session opening: the HTTP status of the upgrade, then (when
    it was upgraded) its first message."""

    http_status: int
    answer: wire.SessionAccepted | wire.StepResult | wire.ProtocolError | None = None


async def open_session(port: int, *, epoch: int, token: str | None) -> Opening:
    """Try to open a step session on ``127.0.0.1:port`` as an admission service would."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as http:
        try:
            ws = await http.ws_connect(f"ws://127.0.0.1:{port}/v1/steps", headers=headers)
        except aiohttp.WSServerHandshakeError as exc:
            return Opening(exc.status)
        async with ws:
            opening = wire.SessionOpen(epoch=epoch, session_id=f"probe-{epoch}")
            await ws.send_str(opening.model_dump_json())
            reply = await ws.receive_str(timeout=30)
            return Opening(101, _SERVER_MESSAGE.validate_json(reply))


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())
