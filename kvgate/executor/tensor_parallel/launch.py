"""``kvgate executor --tensor-parallel-size N``: this process is rank 0 and serves the step
protocol; it starts ranks 1..N-1 as child processes of the same pod, all meeting on
127.0.0.1 (NCCL on CUDA, ranks on cuda:0..N-1; gloo on CPU).

The ranks live and die together: a follower that exits fails the step it was in (or the next)
and stops the server, and the command exits 1, so the pod restarts while the admission service
fails the executor's requests over. When the server stops, the followers are released (STOP) and
waited for; any still running after ``FOLLOWER_EXIT_TIMEOUT_S`` is killed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import wait

from kvgate.executor.config import CheckpointError, load_config
from kvgate.executor.gguf_checkpoint import is_gguf
from kvgate.executor.tensor_parallel.ranks import (
    LOOPBACK,
    RankSpec,
    TensorParallelExecutor,
    build_rank_executor,
    join_group,
    leave_group,
)
from kvgate.executor.tensor_parallel.shards import ShardPlan
from kvgate.protocol.enums import AUTO_DTYPE, DType, ExitPolicy, QuantActivations
from kvgate.step_server.server import StepServer, serve

log = logging.getLogger("kvgate.executor")

FOLLOWER_EXIT_TIMEOUT_S = 30.0
FOLLOWER_MODULE = "kvgate.executor.tensor_parallel.follower"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def rank_specs(
    args: argparse.Namespace, device: str, memory_fraction: float | None
) -> list[RankSpec]:
    port = _free_port()
    return [
        RankSpec(
            rank=rank,
            world_size=args.tensor_parallel_size,
            master_port=port,
            model=args.model,
            device="cuda" if device.startswith("cuda") else device,
            dtype=None if args.dtype == AUTO_DTYPE else DType(args.dtype),
            activations=QuantActivations(args.activations),
            num_blocks=args.num_blocks,
            memory_fraction=memory_fraction,
            block_size=args.block_size,
            host_snapshot_blocks=args.host_snapshot_blocks,
            exit_policy=ExitPolicy(args.exit_policy),
            executor_id=args.executor_id,
        )
        for rank in range(args.tensor_parallel_size)
    ]


def check_splits(args: argparse.Namespace, device: str) -> str | None:
    """Why this model cannot run on ``--tensor-parallel-size`` ranks here, before any starts."""
    world = args.tensor_parallel_size
    if device.startswith("cuda"):
        import torch  # noqa: PLC0415

        visible = torch.cuda.device_count()
        if visible < world:
            return f"--tensor-parallel-size {world} needs {world} GPUs; {visible} visible"
    if is_gguf(args.model):
        return None  # the metadata is read, and checked, by every rank before any tensor
    try:
        ShardPlan(0, world).check(load_config(args.model))
    except CheckpointError as exc:
        return str(exc)
    return None


def run_tensor_parallel(
    args: argparse.Namespace, token: str, device: str, memory_fraction: float | None
) -> int:
    problem = check_splits(args, device)
    if problem is not None:
        log.error("%s", problem)
        return 2
    specs = rank_specs(args, device, memory_fraction)
    followers = [
        subprocess.Popen([sys.executable, "-m", FOLLOWER_MODULE, spec.model_dump_json()])
        for spec in specs[1:]
    ]
    failed = threading.Event()
    stopping = threading.Event()

    def stop_server(reason: str) -> None:
        if not stopping.is_set():
            failed.set()
            log.error("%s; stopping", reason)
            os.kill(os.getpid(), signal.SIGTERM)

    def watch() -> None:
        wait([_sentinel(p) for p in followers])
        exited = [p for p in followers if p.poll() is not None]
        if exited and not stopping.is_set():
            stop_server(f"rank process {exited[0].pid} exited with {exited[0].returncode}")

    threading.Thread(target=watch, name="kvgate-ranks", daemon=True).start()
    backends: list[TensorParallelExecutor] = []

    def load() -> TensorParallelExecutor:
        parallel, channel = join_group(specs[0])
        executor = build_rank_executor(specs[0], parallel)
        backend = TensorParallelExecutor(executor, channel, on_failure=stop_server)
        backends.append(backend)
        if not args.no_calibrate:
            backend.calibrate()
        return backend

    try:
        code = asyncio.run(serve(StepServer(load, token), args.host, args.port))
    finally:
        stopping.set()
        for backend in backends:
            if not failed.is_set():
                backend.stop()
        if not failed.is_set():
            leave_group()
        _reap(followers)
    return 1 if failed.is_set() else code


def _sentinel(proc: subprocess.Popen[bytes]) -> int:
    """A file descriptor that becomes readable when ``proc`` exits (a pidfd)."""
    return os.pidfd_open(proc.pid)


def _reap(followers: list[subprocess.Popen[bytes]]) -> None:
    for proc in followers:
        try:
            proc.wait(timeout=FOLLOWER_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("rank process %d did not exit; killing it", proc.pid)
            proc.kill()
            proc.wait()
