"""``kvgate executor`` as a real process: refuses to start without a token, serves plans over
its WebSocket once ready, and exits cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from kvgate.protocol import step as wire

REPO = Path(__file__).resolve().parents[2]


def _command(model_dir: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "kvgate", "executor", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", *extra,
    ]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVGATE_EXECUTOR_TOKEN"}
    env |= {"PYTHONPATH": str(REPO), "OTEL_SDK_DISABLED": "true", **extra}
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("extra", "env", "message"),
    [
        (("--num-blocks", "8"), {}, "no bearer token"),
        ((), {"KVGATE_EXECUTOR_TOKEN": "t"}, "--num-blocks is required on CPU"),
        (
            ("--num-blocks", "8", "--batch-invariant", "--tensor-parallel-size", "3"),
            {"KVGATE_EXECUTOR_TOKEN": "t"},
            "--batch-invariant runs on one device",
        ),
    ],
    ids=["no-token", "cpu-without-num-blocks", "batch-invariant-over-ranks"],
)
def test_refuses_to_start(
    llama_dir: Path, extra: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    done = subprocess.run(
        _command(llama_dir, _free_port(), *extra),
        env=_env(**env), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert message in done.stderr


async def _serve_one_plan(port: int, token: str) -> wire.StepResult:
    deadline = time.monotonic() + 120
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(f"http://127.0.0.1:{port}/readyz") as ready:
                    if ready.status == 200:
                        break
            except aiohttp.ClientConnectionError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("the executor did not become ready")
            await asyncio.sleep(0.2)
        headers = {"Authorization": f"Bearer {token}"}
        async with http.ws_connect(f"http://127.0.0.1:{port}/v1/steps", headers=headers) as ws:
            await ws.send_str(wire.SessionOpen(epoch=1, session_id="cli").model_dump_json())
            accepted = wire.SessionAccepted.model_validate_json(await ws.receive_str(timeout=30))
            assert accepted.info.host_bandwidth_bytes_per_s is not None  # calibrated at start
            plan = wire.StepPlan(
                step_id=1,
                new_requests=[wire.NewRequest(request_id="r", prompt_token_ids=[1, 2, 3])],
                block_appends=[wire.BlockAppend(request_id="r", new_block_ids=[[0]])],
                prefill_rows=[
                    wire.PrefillRow(
                        request_id="r", token_start=0, token_end=3, depth_first=1, depth_last=1,
                        completes_fill=True,
                    )
                ],
            )  # fmt: skip
            await ws.send_str(plan.model_dump_json())
            return wire.StepResult.model_validate(json.loads(await ws.receive_str(timeout=30)))


def test_serves_plans_and_stops_on_sigterm(llama_dir: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")
    port = _free_port()
    process = subprocess.Popen(
        _command(llama_dir, port, "--num-blocks", "32", "--token-file", str(token_file)),
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        result = asyncio.run(_serve_one_plan(port, "file-token"))
        assert result.error is None and [t.position for t in result.sampled_tokens()] == [3]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate(timeout=30)[0]
    assert "listening on 127.0.0.1" in output


def test_help_does_not_import_torch() -> None:
    probe = (
        "import sys\n"
        "from kvgate.cli import main\n"
        "try:\n"
        "    main(['executor', '--help'])\n"
        "except SystemExit as exit_:\n"
        "    code = exit_.code\n"
        "heavy = ('torch', 'triton', 'numpy', 'safetensors')\n"
        "heavy = sorted(m for m in heavy if m in sys.modules)\n"
        "print('imported:', heavy, 'exit:', code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--model" in done.stdout and "--block-size" in done.stdout
    assert done.stdout.splitlines()[-1] == "imported: [] exit: 0"


def test_the_executor_listens_on_loopback_unless_told_otherwise() -> None:
    from kvgate.cli import build_parser

    argv = ["executor", "--model", "m"]
    assert build_parser(argv).parse_args(argv).host == "127.0.0.1"
