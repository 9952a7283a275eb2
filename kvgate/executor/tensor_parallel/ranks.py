"""One executor over ``N`` ranks: rank 0 speaks the step protocol, the others follow it.

```
admission service ──StepPlan──▶ rank 0: TensorParallelExecutor.execute(plan)
                                  │ ControlChannel: EXECUTE + plan JSON
                                  ▼
                                ranks 1..N-1: follow() -> Executor.execute(plan)
every rank: validate -> free/swap/register/append -> forward (all-reduce, all-gather) -> sample
```
Every rank holds a whole ``Executor`` over its shard: its own request states, block reference
counts, snapshots (its KV heads' blocks on the host) and its KV cache under the shared block
tables, all changed by the same plans in the same order. So preemption by swap or by recompute
needs no code of its own: each rank gathers and scatters its own heads.

Sampling runs on every rank, from the same gathered fp32 logits with the sampler's generator
seeded per (seed, request, position), so every rank draws the same token and takes the same exit
decision without a broadcast per step. The alternative, rank 0 samples and broadcasts, costs a
collective per step and would still need the exit decisions between loop levels broadcast too;
what it guards against (ranks seeing different logits) cannot happen, since the logits and the
hidden states after each all-reduce are the same buffers on every rank. Only rank 0's result is
sent; the followers' are dropped.

A rank that fails (a collective errors because a peer died, or any exception inside a step)
leaves the ranks' states out of step with one another: the executor answers that step and every
later one with an INTERNAL error and calls ``on_failure`` (the launcher then stops the pod's
ranks), so the admission service fails its requests over to another executor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Annotated, cast

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from kvgate.executor.calibration import profile_forward
from kvgate.executor.config import DEFAULT_BLOCK_SIZE
from kvgate.executor.executor import PROFILE_TOKENS, Executor
from kvgate.executor.kv_cache import blocks_for_memory_fraction
from kvgate.executor.loader import load_model
from kvgate.executor.tensor_parallel.channel import Command, ControlChannel
from kvgate.executor.tensor_parallel.layers import TensorParallel
from kvgate.executor.tensor_parallel.shards import ShardPlan
from kvgate.protocol import step as wire
from kvgate.protocol.enums import AUTO_DTYPE, DType, ExitPolicy, QuantActivations

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"  # the ranks of one executor share a pod; they never listen elsewhere


class RankSpec(BaseModel):
    """What one rank needs to join its group and load its shard (passed to followers as JSON)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=2)]
    master_port: Annotated[int, Field(ge=1, le=65535)]
    model: Path
    device: str  # "cpu" or "cuda": rank r takes cuda:r
    dtype: DType | None = None  # None: auto
    activations: QuantActivations = QuantActivations.FLOAT32  # a quantized GGUF's, on CPU
    num_blocks: Annotated[int, Field(ge=1)] | None = None
    memory_fraction: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    block_size: Annotated[int, Field(ge=1)] = DEFAULT_BLOCK_SIZE
    host_snapshot_blocks: Annotated[int, Field(ge=0)] = 0
    exit_policy: ExitPolicy = ExitPolicy.GATE
    executor_id: str = "executor-0"
    collective_timeout_s: Annotated[float, Field(gt=0.0)] = 300.0

    @property
    def torch_device(self) -> torch.device:
        return torch.device(f"cuda:{self.rank}" if self.device == "cuda" else self.device)


def join_group(spec: RankSpec) -> tuple[TensorParallel, ControlChannel]:
    """Collective: join the ranks on 127.0.0.1 (NCCL on CUDA, gloo on CPU) and the control group."""
    device = spec.torch_device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{LOOPBACK}:{spec.master_port}",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.collective_timeout_s),
    )
    channel = ControlChannel.create()
    world = cast(dist.ProcessGroup, dist.group.WORLD)
    return TensorParallel(ShardPlan(spec.rank, spec.world_size), world), channel


def leave_group() -> None:
    """Tear down this rank's process groups (the world and the control group) before the process
    exits: left to interpreter teardown, gloo's worker threads can still be joinable when their
    owner is destroyed, and the process aborts (``terminate called without an active
    exception``) after a clean run."""
    if dist.is_initialized():
        dist.destroy_process_group()


def build_rank_executor(spec: RankSpec, parallel: TensorParallel) -> Executor:
    """Collective: this rank's shard and KV cache; every rank ends with the same block count."""
    device = spec.torch_device
    loaded = load_model(
        spec.model,
        device=device,
        dtype=spec.dtype or AUTO_DTYPE,
        parallel=parallel,
        activations=spec.activations,
    )
    num_blocks = spec.num_blocks
    if num_blocks is None:
        if spec.memory_fraction is None:
            raise ValueError("give num_blocks, or memory_fraction on a CUDA device")
        model = loaded.model
        mine = blocks_for_memory_fraction(
            model.config,
            block_size=spec.block_size,
            dtype=model.dtype,
            device=device,
            memory_fraction=spec.memory_fraction,
            profile=lambda: profile_forward(model, PROFILE_TOKENS),
        )
        fewest = torch.tensor([mine], dtype=torch.int64, device=device)
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=parallel.group)
        num_blocks = int(fewest.item())
    return Executor(
        loaded,
        num_blocks=num_blocks,
        host_snapshot_blocks=spec.host_snapshot_blocks,
        executor_id=spec.executor_id,
        block_size=spec.block_size,
        exit_policy=spec.exit_policy,
        model_name=str(spec.model),  # as the single-process executor names it (its --model)
    )


class TensorParallelExecutor:
    """Rank 0's step backend: each call goes to the followers first, then runs here."""

    def __init__(
        self,
        executor: Executor,
        channel: ControlChannel,
        on_failure: Callable[[str], None] | None = None,
    ):
        self.executor = executor
        self._channel = channel
        self._on_failure = on_failure
        self.failure: str | None = None

    @property
    def info(self) -> wire.ExecutorInfo:
        # Each rank holds a shard of the KV: snapshots do not leave a tensor-parallel executor
        # (yet), so drains off it recompute and migrations never pick it as a receiver.
        return self.executor.info.model_copy(update={"snapshot_migration": False})

    @property
    def counters(self) -> wire.ExecutorCounters:
        return self.executor.counters

    def reset(self) -> None:
        if self.failure is None:
            self._channel.send(Command.RESET)
            self.executor.reset()

    def calibrate(self) -> wire.ExecutorInfo:
        self._channel.send(Command.CALIBRATE)
        return self.executor.calibrate()

    def stop(self) -> None:
        """Release the followers (they return from ``follow``)."""
        if self.failure is None:
            self._channel.send(Command.STOP)

    def execute(self, plan: wire.StepPlan) -> wire.StepResult:
        began = time.perf_counter()
        if self.failure is None:
            try:
                self._channel.send(Command.EXECUTE, plan.model_dump_json().encode())
            except RuntimeError as exc:  # a follower is gone
                self._fail(f"step {plan.step_id}: a rank is unreachable: {exc}")
            else:
                result = self.executor.execute(plan)
                error = result.error
                if error is None or error.code is not wire.ErrorCode.INTERNAL:
                    return result
                self._fail(f"step {plan.step_id} failed on rank 0: {error.message}")
        assert self.failure is not None
        return wire.StepResult(
            step_id=plan.step_id,
            error=wire.StepError(code=wire.ErrorCode.INTERNAL, message=self.failure),
            counters=self.counters,
            timings=wire.StepTimings(execute_s=time.perf_counter() - began),
        )

    def _fail(self, reason: str) -> None:
        log.error("tensor-parallel executor failed: %s", reason)
        self.failure = f"tensor-parallel executor failed ({reason}); it serves no more steps"
        if self._on_failure is not None:
            self._on_failure(self.failure)


class FollowerFailed(RuntimeError):
    """A step failed on a follower: its state no longer matches rank 0's."""


def follow(executor: Executor, channel: ControlChannel) -> None:
    """Ranks 1..N-1: run what rank 0 sends until it sends STOP (raises when a step fails)."""
    while True:
        command, payload = channel.receive()
        if command is Command.STOP:
            return
        if command is Command.RESET:
            executor.reset()
        elif command is Command.CALIBRATE:
            executor.calibrate()
        else:
            plan = wire.StepPlan.model_validate_json(payload)
            error = executor.execute(plan).error
            if error is not None and error.code is wire.ErrorCode.INTERNAL:
                raise FollowerFailed(f"step {plan.step_id}: {error.message}")
