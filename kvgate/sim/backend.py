"""The simulated executor behind the session protocol: in-process sessions and epoch fencing.

:class:`SimBackend` is one simulated executor with the real executor's session rules
(:class:`~kvgate.protocol.session.EpochFence`): accepting an epoch resets the executor and
fences the older session out. :class:`LocalConnector` opens in-process sessions
to named backends (tests and the ingest benchmark: the whole service without a network);
``kvgate sim-executor`` (:mod:`kvgate.sim.server`) serves a backend over the
real WebSocket protocol.

Fault injection for tests: :meth:`LocalConnector.lose` breaks a backend's open session,
:meth:`SimBackend.hold` keeps results back until :meth:`SimBackend.release` (a slow executor),
and ``refuse`` makes new sessions fail to connect. Migration: a local session imports a
snapshot from another local backend through the same frames, checks and staging as the
WebSocket server (:mod:`kvgate.step_server.snapshots`); :meth:`LocalConnector.kill` makes an
executor vanish with its exports, ``before_fetch`` runs just before each fetch and ``tamper``
may rewrite a transfer's frames (a corrupted chunk).
"""

from __future__ import annotations

import argparse
import asyncio
from collections import deque
from collections.abc import Callable
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from kvgate.admission_service.executor_client import ConnectFailed, SessionLost, SessionRefused
from kvgate.protocol import migration
from kvgate.protocol import step as wire
from kvgate.protocol.migration import (
    SnapshotHeader,
    SnapshotLayout,
    SnapshotStaged,
    TransferError,
    TransferFailure,
)
from kvgate.protocol.session import EpochFence
from kvgate.protocol.tokenizer_files import TokenizerFiles
from kvgate.sim.executor import SimExecutor
from kvgate.sim.workload import ExitMode, ModelSection
from kvgate.step_server.snapshots import MigrationLimits, decode_frames, stage


class SimExecutorConfig(BaseModel):
    """A simulated executor: its model (deterministic token function) and cache geometry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    executor_id: str = "sim-0"
    loops: Annotated[int, Field(ge=1, le=64)] = 1
    min_loops: Annotated[int, Field(ge=1)] = 1
    exit: ExitMode = ExitMode.HASH
    vocab_size: Annotated[int, Field(ge=2)] = 512
    seed: Annotated[int, Field(ge=0)] = 0
    eos_token_id: Annotated[int, Field(ge=0)] | None = None
    num_blocks: Annotated[int, Field(ge=1)] = 256
    block_size: Annotated[int, Field(ge=1, le=1024)] = 16
    host_snapshot_blocks: Annotated[int, Field(ge=0)] = 0

    def model(self) -> ModelSection:
        """The simulated model this executor runs, as a workload file names it."""
        return ModelSection(
            loops=self.loops,
            min_loops=self.min_loops,
            exit=self.exit,
            vocab_size=self.vocab_size,
            seed=self.seed,
            eos_token_id=self.eos_token_id,
        )

    def build(self) -> SimExecutor:
        return SimExecutor(
            self.model(),
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            host_snapshot_blocks=self.host_snapshot_blocks,
            executor_id=self.executor_id,
        )


def add_config_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The command-line options of a :class:`SimExecutorConfig` (model and cache geometry), for
    every command that runs a simulated executor."""
    defaults = SimExecutorConfig()
    parser.add_argument("--num-blocks", type=int, default=defaults.num_blocks)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--host-snapshot-blocks", type=int, default=0)
    parser.add_argument("--loops", type=int, default=defaults.loops)
    parser.add_argument("--min-loops", type=int, default=defaults.min_loops)
    parser.add_argument("--exit", choices=[m.value for m in ExitMode], default=defaults.exit.value)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--eos-token-id", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)


def config_from_arguments(args: argparse.Namespace, **fields: str) -> SimExecutorConfig:
    """The config :func:`add_config_arguments` options describe (raises ValidationError)."""
    return SimExecutorConfig(
        loops=args.loops,
        min_loops=args.min_loops,
        exit=ExitMode(args.exit),
        vocab_size=args.vocab_size,
        seed=args.seed,
        eos_token_id=args.eos_token_id,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        host_snapshot_blocks=args.host_snapshot_blocks,
        **fields,
    )


class SimBackend:
    """One simulated executor and its epoch fence (shared by local and WebSocket serving)."""

    def __init__(self, config: SimExecutorConfig, *, fence: EpochFence | None = None) -> None:
        self.config = config
        # Served at GET /v1/tokenizer when set (`kvgate sim-executor --tokenizer FILE`).
        self.tokenizer_files: TokenizerFiles | None = None
        self.executor = config.build()
        self.fence = fence or EpochFence()
        self.steps = 0
        # The last plans' traceparents, for tracing tests (bounded: a sim-executor runs for
        # hours in benchmarks).
        self.plan_traceparents: deque[str | None] = deque(maxlen=4096)
        self._current: LocalSession | None = None
        self._held = False
        self._hold_at_step: int | None = None
        self._released = asyncio.Event()
        self._released.set()

    @property
    def info(self) -> wire.ExecutorInfo:
        return self.executor.info

    @property
    def counters(self) -> wire.ExecutorCounters:
        return self.executor.counters

    def reset(self) -> None:
        self.executor.reset()

    # Migration: the step server serves exports and stages imports through these.
    @property
    def snapshot_layout(self) -> SnapshotLayout:
        return self.executor.snapshot_layout

    def take_export(self, ticket: str) -> tuple[SnapshotHeader, bytes] | None:
        return self.executor.take_export(ticket)

    def drop_export(self, ticket: str) -> None:
        self.executor.drop_export(ticket)

    def stage_import(self, ticket: str, header: SnapshotHeader, payload: bytes) -> None:
        self.executor.stage_import(ticket, header, payload)

    def drop_staged(self, ticket: str) -> None:
        self.executor.drop_staged(ticket)

    def execute(self, plan: wire.StepPlan) -> wire.StepResult:
        self.steps += 1
        self.plan_traceparents.append(plan.traceparent)
        return self.executor.execute(plan)

    def hold_after(self, steps: int) -> None:
        """Hold results from the ``steps``-th step on (a deterministic point mid-run)."""
        self._hold_at_step = self.steps + steps

    def hold(self) -> None:
        """Keep results back (plans still run in order when released)."""
        self._held = True
        self._released.clear()

    def release(self) -> None:
        self._held = False
        self._released.set()

    async def wait_released(self) -> None:
        """Awaited before each plan runs: returns once results are not held back."""
        if self._hold_at_step is not None and self.steps >= self._hold_at_step:
            self._hold_at_step = None
            self.hold()
        await self._released.wait()


class LocalSession:
    """An in-process session: plans run in order on one worker task, as on an executor."""

    def __init__(
        self, backend: SimBackend, epoch: int, connector: LocalConnector | None = None
    ) -> None:
        self.backend = backend
        self.epoch = epoch
        self._connector = connector
        self._plans: asyncio.Queue[wire.StepPlan] = asyncio.Queue()
        self._results: asyncio.Queue[wire.StepResult | SessionLost] = asyncio.Queue()
        self._lost: SessionLost | None = None
        self._lost_event = asyncio.Event()
        self._worker = asyncio.create_task(self._work(), name="kvgate-local-executor")

    @property
    def info(self) -> wire.ExecutorInfo:
        return self.backend.info

    async def _work(self) -> None:
        while True:
            plan = await self._plans.get()
            await self.backend.wait_released()
            if self._lost is not None:
                return
            self._results.put_nowait(self.backend.execute(plan))

    async def send(self, plan: wire.StepPlan) -> None:
        if self._lost is not None:
            raise self._lost
        # Through JSON, as on the wire: the executor sees what a real one would parse.
        self._plans.put_nowait(wire.StepPlan.model_validate_json(plan.model_dump_json()))

    async def receive(self) -> wire.StepResult:
        item = await self._results.get()
        if isinstance(item, SessionLost):
            self._results.put_nowait(item)
            raise item
        return item

    async def wait_lost(self) -> SessionLost:
        await self._lost_event.wait()
        assert self._lost is not None
        return self._lost

    def lose(self, reason: str, *, fenced: bool = False) -> None:
        if self._lost is None:
            self._lost = SessionLost(reason, fenced=fenced)
            self._lost_event.set()
            self._results.put_nowait(self._lost)
        self._worker.cancel()

    async def import_snapshot(
        self, source_endpoint: str, ticket: str, request_id: str, timeout_s: float
    ) -> SnapshotStaged:
        connector = self._connector
        if self._lost is not None or connector is None:
            raise TransferError(TransferFailure.RECEIVER_LOST, "the session is not open")
        return connector.transfer(source_endpoint, ticket, request_id, self.backend)

    async def close(self) -> None:
        self.lose("closed by the admission service")
        if self.backend._current is self:
            self.backend._current = None


class LocalConnector:
    """In-process sessions to simulated executors; an endpoint's last path segment names the
    backend (``ws://local/<name>``)."""

    def __init__(self, backends: dict[str, SimBackend] | None = None) -> None:
        self.backends: dict[str, SimBackend] = dict(backends or {})
        self.refused: set[str] = set()
        self.connects = 0
        self.limits = MigrationLimits()
        # Called with the source's name and the request whose snapshot is about to be fetched.
        self.before_fetch: Callable[[str, str], None] | None = None
        self.tamper: Callable[[list[bytes]], list[bytes]] | None = None
        self.transfers = 0

    def add(self, name: str, config: SimExecutorConfig) -> SimBackend:
        backend = SimBackend(config)
        self.backends[name] = backend
        return backend

    async def __call__(self, endpoint: str, epoch: int) -> LocalSession:
        name = endpoint.rstrip("/").rsplit("/", 1)[-1]
        backend = self.backends.get(name)
        if backend is None or name in self.refused:
            raise ConnectFailed(f"{endpoint}: no such executor is reachable")
        refusal = backend.fence.accept(wire.SessionOpen(epoch=epoch, session_id=f"local-{name}"))
        if refusal is not None:
            raise SessionRefused(refusal.code, refusal.message)
        backend.reset()
        if backend._current is not None:
            backend._current.lose(f"session epoch {epoch} replaced this one", fenced=True)
        self.connects += 1
        session = LocalSession(backend, epoch, self)
        backend._current = session
        return session

    def lose(self, name: str) -> None:
        """Break the open session of ``name`` (as if the executor died)."""
        session = self.backends[name]._current
        if session is not None:
            session.lose("connection reset (fault injected)")
            self.backends[name]._current = None

    def kill(self, name: str) -> None:
        """The executor ``name`` dies: its session breaks, it refuses connections, and what it
        held (requests, snapshots, exports) is gone."""
        self.lose(name)
        self.refused.add(name)
        self.backends[name].reset()

    def transfer(
        self, source_endpoint: str, ticket: str, request_id: str, receiver: SimBackend
    ) -> SnapshotStaged:
        """One snapshot from the backend at ``source_endpoint`` to ``receiver``, framed and
        checked as on the wire."""
        name = source_endpoint.rstrip("/").rsplit("/", 1)[-1]
        if self.before_fetch is not None:
            self.before_fetch(name, request_id)
        source = self.backends.get(name)
        if source is None or name in self.refused:
            raise TransferError(TransferFailure.SENDER_GONE, f"{source_endpoint} is unreachable")
        taken = source.take_export(ticket)
        if taken is None:
            raise TransferError(TransferFailure.NOT_FOUND, "no snapshot under this ticket")
        frames = list(migration.encode(*taken, self.limits.chunk_bytes))
        if self.tamper is not None:
            frames = self.tamper(frames)
        header, payload = decode_frames(
            frames, max_bytes=self.limits.max_snapshot_bytes, layout=receiver.snapshot_layout
        )
        self.transfers += 1
        return stage(receiver, ticket, request_id, header, payload)
