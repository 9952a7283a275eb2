"""Tensor parallelism at world size 2 on CPU (gloo, two processes on 127.0.0.1): the two-rank
executor generates exactly what the one-process executor generates, for both model families,
under chunked and wavefront fills, async plans, swap and recompute preemption; a model whose
heads do not divide is refused in one line; a rank dying mid-step fails the step at once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.executor.config import CheckpointError, ModelConfig
from kvgate.executor.executor import Executor
from kvgate.executor.loader import load_model
from kvgate.executor.tensor_parallel.shards import ShardError, ShardPlan
from kvgate.executor.tiny_model import make_tiny_model
from kvgate.protocol.enums import ModelFamily
from tests.executor.driver import Driver
from tests.executor.test_executor_cli import _command, _env, _serve_one_plan
from tests.executor.tp_scenarios import SCENARIOS, TP_SPECS, tp_requests

RANK_DEADLINE_S = 240.0


@pytest.fixture(scope="module")
def tp_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: make_tiny_model(tmp_path_factory.mktemp(f"tp-{name}"), spec)
        for name, spec in TP_SPECS.items()
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _run_ranks(task: str, out: Path, models: list[Path]) -> list[int]:
    """Both ranks to completion (bounded by a deadline); their exit codes."""
    port = str(_free_port())
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.executor.tp_rank", task, str(rank), port, str(out)]
            + [str(m) for m in models],
            env=env,
        )
        for rank in range(2)
    ]
    try:
        return [p.wait(timeout=RANK_DEADLINE_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_two_ranks_match_one_process(tp_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "outputs.json"
    assert _run_ranks("equality", out, list(tp_dirs.values())) == [0, 0]
    got = json.loads(out.read_text())
    for name, model_dir in tp_dirs.items():
        loaded = load_model(model_dir)
        for scenario, cfg in SCENARIOS.items():
            executor = Executor(loaded, num_blocks=400, block_size=4, host_snapshot_blocks=200)
            expected = Driver(
                executor, tp_requests(loaded.model, executor.info.structured_outputs), cfg
            ).run()
            # JSON turns the (tokens, depths) tuples into lists.
            assert got[model_dir.name][scenario] == {
                rid: [tokens, depths] for rid, (tokens, depths) in expected.items()
            }, (name, scenario)


def test_rank_dying_mid_step_fails_the_step(tp_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "errors.json"
    codes = _run_ranks("die", out, [tp_dirs["llama"]])
    assert codes == [0, 17]  # rank 0 reported and finished; rank 1 died where it was told to
    errors = json.loads(out.read_text())[tp_dirs["llama"].name]["errors"]
    failed_step, stopped, next_step = errors
    assert "tensor-parallel executor failed" in failed_step
    assert stopped.startswith("driver stopped: step ")  # the failure reached the step's result
    assert next_step == failed_step  # later steps are refused with the same reason


def _config(heads: int, kv_heads: int, inter: int = 64) -> ModelConfig:
    return ModelConfig(
        family=ModelFamily.LLAMA,
        model_type="llama",
        vocab_size=100,
        hidden_size=heads * 8,
        intermediate_size=inter,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=8,
    )


def test_smollm2_heads_do_not_split_over_two_ranks() -> None:
    # SmolLM2-135M: 9 query heads, 3 KV heads, intermediate 1536.
    with pytest.raises(ShardError) as caught:
        ShardPlan(0, 2).check(_config(9, 3, 1536))
    assert str(caught.value) == (
        "num_attention_heads 9 is not divisible by --tensor-parallel-size 2 "
        "(choose a size that divides it)"
    )
    assert isinstance(caught.value, CheckpointError)  # the CLI's one-line load error
    ShardPlan(0, 3).check(_config(9, 3, 1536))  # three ranks: one KV head each


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world", "message"),
    [
        (8, 3, 4, "num_key_value_heads 3 and --tensor-parallel-size 4 do not divide"),
        (8, 4, 8, None),  # KV heads replicated: two ranks per KV head
        (8, 8, 4, None),
    ],
)
def test_kv_heads_split_or_replicate(
    heads: int, kv_heads: int, world: int, message: str | None
) -> None:
    config = _config(heads, kv_heads) if heads % kv_heads == 0 else None
    if config is None:
        config = _config(heads, 1).model_copy(update={"num_kv_heads": kv_heads})
    if message is not None:
        with pytest.raises(ShardError, match=message):
            ShardPlan(0, world).check(config)
        return
    group = heads // kv_heads
    for rank in range(world):
        plan = ShardPlan(rank, world)
        k = plan.slice_of("model.layers.0.self_attn.k_proj.weight", config)
        q = plan.slice_of("model.layers.0.self_attn.q_proj.weight", config)
        assert k is not None and q is not None
        # Every query head of this rank reads one of the KV heads this rank holds.
        kv_held = range(k.start // 8, k.stop // 8)
        assert all(h // group in kv_held for h in range(q.start // 8, q.stop // 8))


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.parametrize(
    "stop", [pytest.param("sigterm", marks=pytest.mark.slow), "follower-killed"]
)
def test_cli_serves_over_two_ranks(tp_dirs: dict[str, Path], tmp_path: Path, stop: str) -> None:
    """``kvgate executor --tensor-parallel-size 2`` serves a plan; SIGTERM releases the follower
    and exits 0; a follower killed makes the executor exit 1 (its pod restarts)."""
    token_file = tmp_path / "token"
    token_file.write_text("tp-token\n")
    port = _free_port()
    extra = ("--num-blocks", "32", "--token-file", str(token_file), "--tensor-parallel-size", "2")
    process = subprocess.Popen(
        _command(tp_dirs["llama"], port, *extra),
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        result = asyncio.run(_serve_one_plan(port, "tp-token"))
        assert result.error is None and [t.position for t in result.sampled_tokens()] == [3]
        (follower,) = _children(process.pid)
        if stop == "sigterm":
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0
        else:
            os.kill(follower, signal.SIGKILL)
            assert process.wait(timeout=60) == 1
        assert not Path(f"/proc/{follower}").exists() or _zombie(follower)
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate(timeout=30)[0]
    if stop == "follower-killed":
        assert "exited with -9; stopping" in output


def _zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_cli_refuses_heads_that_do_not_split(tp_dirs: dict[str, Path]) -> None:
    done = subprocess.run(
        _command(
            tp_dirs["llama"], _free_port(), "--num-blocks", "8", "--tensor-parallel-size", "3"
        ),
        env=_env(KVGATE_EXECUTOR_TOKEN="t"), capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "num_attention_heads 4 is not divisible by --tensor-parallel-size 3" in done.stderr
