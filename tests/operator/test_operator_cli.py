"""``kvgate operator``: its options, and the real command run as a process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import kopf
import pytest

from kvgate.cli import build_parser
from kvgate.operator.handlers import startup
from tests.operator.cluster import Cluster, pool_manifest


def parse(*argv: str) -> object:
    return build_parser(["operator", *argv]).parse_args(["operator", *argv])


def test_options() -> None:
    args = vars(parse("-n", "a", "--namespace", "b"))
    assert args["namespaces"] == ["a", "b"]
    assert args["all_namespaces"] is False
    assert (args["peering"], args["standalone"]) == ("kvgate-operator", False)
    assert args["liveness"] == "http://0.0.0.0:8081/healthz"
    assert vars(parse("-A", "--standalone"))["all_namespaces"] is True


@pytest.mark.parametrize("argv", [(), ("-A", "-n", "x")])
def test_a_scope_is_required_and_single(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        parse(*argv)
    assert caught.value.code == 2
    assert "--namespace" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_the_command_runs_the_operator_with_a_liveness_endpoint(cluster: Cluster) -> None:
    port = _free_port()
    root = Path(__file__).parents[2]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgate",
        "operator",
        "--standalone",
        "--namespace",
        "default",
        "--liveness",
        f"http://127.0.0.1:{port}/healthz",
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await cluster.create(pool_manifest(replicas=1))
        await cluster.wait_for(cluster.ready, within_s=30)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/healthz") as response,
        ):
            assert response.status == 200
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 0, stderr.decode()[-3000:]
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_bad_settings_stop_the_operator_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_OPERATOR_POLL_INTERVAL_S", "-1")
    memo = kopf.Memo()
    with pytest.raises(kopf.PermanentError, match="poll_interval_s"):
        await startup(settings=kopf.OperatorSettings(), memo=memo)
    assert "kvgate_runtime" not in memo
