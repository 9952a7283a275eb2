"""One executor as the service sees it: its session, its scheduler and its step loop.

```
 CONNECTING ──accepted──▶ READY ──drain──▶ DRAINING ──empty──▶ DRAINED
      ▲                     │                  │
      └──backoff── LOST ◀───┴── session breaks ┘   (requests resume elsewhere by recompute)
```

Each accepted session gets a fresh :class:`Scheduler` sized from the executor's
``ExecutorInfo`` (the executor reset itself when it accepted the epoch). The step loop keeps at
most one plan in flight beyond the one being applied when ``async_scheduling`` is on: it plans
step N+1, sends it, and only then applies step N's result.

Lifting requests out of a draining executor happens at a quiescent point — no plan in flight —
with ``evacuate(executor_alive=True)``, so the next plan frees their state there. With
``migrate_on_drain`` the requests at a token boundary are exported instead: the handle sends
the plan that exports their KV under one-time tickets, waits for its result, and hands them
back with the tickets, so the engine can move them to another executor with their KV (see
docs/admission-service.md, "KV snapshot migration"). An executor
that leaves (removed from the membership, or the service stops) or is lost does not wait for
its plans in flight: its session closes and ``evacuate(executor_alive=False)`` lifts everything;
the executor resets when a session opens again. Either way the requests resume elsewhere by
recompute. The handle owns its scheduler: requests are placed on it (with their full-length KV
reservation), aborted and lifted through the handle; it reports every event to its
:class:`PoolObserver` (the engine) and never decides where requests go.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvgate.admission_service.executor_client import (
    ConnectFailed,
    Connector,
    EpochClock,
    ImportsSnapshots,
    SessionLost,
    SessionRefused,
    StepSession,
)
from kvgate.backoff import jittered_delay_s
from kvgate.protocol import capacity
from kvgate.protocol.admin import ExecutorSpec, ExecutorState, ExecutorStatus
from kvgate.protocol.enums import FinishReason
from kvgate.protocol.migration import SnapshotStaged, TransferError, TransferFailure
from kvgate.protocol.records import RejectCode
from kvgate.protocol.step import ExecutorCounters, ExecutorInfo, StepPlan, StepResult
from kvgate.scheduler.config import CacheConfig, ModelShape, SchedulerConfig
from kvgate.scheduler.errors import (
    PlanRejected,
    RequestRejected,
    SchedulerStalled,
)
from kvgate.scheduler.events import RequestEvent, StepReport
from kvgate.scheduler.request import ImportedSnapshot, RequestProgress, RequestSpec
from kvgate.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

# After a fence, wait about the longest reconnect delay (a retry count past the cap).
_FENCED_RETRY = 64
_IDLE_POLL_S = 0.05  # re-plan while work exists but nothing can be planned (deadlines)


@dataclass(frozen=True, slots=True)
class SessionSettings:
    reconnect_initial_s: float
    reconnect_max_s: float
    enable_prefix_caching: bool
    # Drains move requests at a token boundary with their KV (both executors must support it).
    migrate_on_drain: bool = False
    migration_timeout_s: float = 30.0  # one snapshot's fetch and staging on the receiver
    export_ttl_s: float = 30.0  # how long the leaving executor holds an unfetched export


class PoolObserver(Protocol):
    """What an executor handle tells the engine."""

    def on_ready(self, handle: ExecutorHandle) -> None: ...

    def on_events(self, handle: ExecutorHandle, events: list[RequestEvent]) -> None: ...

    def on_lifted(
        self,
        handle: ExecutorHandle,
        lifted: list[RequestProgress],
        failure: str | None,
        tickets: Mapping[str, str] | None = None,
    ) -> None:
        """``tickets`` (a drain with migration on): request id -> the ticket its exported KV
        waits under on this executor; None when the lift did not consider migration."""
        ...

    def before_send(self, handle: ExecutorHandle, plan: StepPlan, report: StepReport) -> StepPlan:
        """The plan to send (the engine adds the step span's trace context)."""
        ...

    def after_apply(
        self, handle: ExecutorHandle, plan: StepPlan, result: StepResult, round_trip_s: float
    ) -> None: ...


def scheduler_for(info: ExecutorInfo, config: SchedulerConfig, prefix_caching: bool) -> Scheduler:
    """A scheduler for the executor ``info`` describes, with its measured cost figures."""
    updates: dict[str, float] = {}
    if info.host_bandwidth_bytes_per_s is not None and info.kv_bytes_per_block > 0:
        updates["snapshot_block_cost_s"] = (
            2 * info.kv_bytes_per_block / info.host_bandwidth_bytes_per_s
        )
    if info.prefill_token_pass_s is not None:
        updates["recompute_token_pass_cost_s"] = info.prefill_token_pass_s
    cache = CacheConfig(
        num_blocks=info.num_blocks,
        block_size=info.block_size,
        host_snapshot_blocks=info.host_snapshot_blocks,
        enable_prefix_caching=prefix_caching,
    )
    model = ModelShape(
        num_loops=info.num_loops,
        eos_token_id=info.eos_token_id,
        max_model_len=info.max_model_len,
    )
    return Scheduler(config.model_copy(update=updates), cache, model)


class ExecutorHandle:
    def __init__(
        self,
        spec: ExecutorSpec,
        *,
        connector: Connector,
        epochs: EpochClock,
        scheduler_config: SchedulerConfig,
        settings: SessionSettings,
        observer: PoolObserver,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self._connector = connector
        self._epochs = epochs
        self._config = scheduler_config
        self._settings = settings
        self._observer = observer
        self._clock = clock
        self.draining = spec.draining
        self.info: ExecutorInfo | None = None
        self.scheduler: Scheduler | None = None
        self.connected = False
        self.lost_reason: str | None = None
        self._reserved: dict[str, int] = {}  # request id -> its full-length KV need here
        self.reserved_blocks = 0  # their sum
        # Requests queued here that have not started (placement's backlog): id -> fill tokens,
        # in the order they were placed.
        self._unstarted: dict[str, int] = {}
        self.backlog_tokens = 0  # their sum
        # What the executor reported holding after its last step (None: no session).
        self.reported: ExecutorCounters | None = None
        self.sessions = 0
        self._session: StepSession | None = None
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._evacuate = False
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------------ views
    @property
    def state(self) -> ExecutorState:
        if self.scheduler is None or not self.connected:
            return ExecutorState.LOST if self.lost_reason is not None else ExecutorState.CONNECTING
        if not self.draining:
            return ExecutorState.READY
        return ExecutorState.DRAINING if self.scheduler.has_work else ExecutorState.DRAINED

    @property
    def accepts_work(self) -> bool:
        return self.state is ExecutorState.READY

    @property
    def host_blocks_used(self) -> int:
        """Host snapshot blocks the scheduler accounts to preempted requests here."""
        return self.scheduler.state.host_blocks_used if self.scheduler is not None else 0

    @property
    def headroom_blocks(self) -> int:
        """Cache blocks minus the full-length need of every request placed here."""
        return 0 if self.info is None else self.info.num_blocks - self.reserved_blocks

    # --- what placement reads (placement.ExecutorView) ----------------------------------------
    @property
    def block_size(self) -> int:
        return self.info.block_size if self.info is not None else 1

    @property
    def outstanding(self) -> int:
        """Requests placed here and not finished."""
        return len(self._reserved)

    def cached_prefix_pages(self, digests: Sequence[bytes]) -> int:
        return self.scheduler.cached_prefix_pages(digests) if self.scheduler is not None else 0

    def has_room_for(self, prompt_len: int, max_tokens: int) -> bool:
        info = self.info
        if info is None:
            return False
        need = capacity.blocks_for(
            prompt_len, max_tokens, block_size=info.block_size, num_planes=info.num_loops
        )
        return self.headroom_blocks >= need

    def unstarted(self, limit: int) -> list[str]:
        """The first ``limit`` requests queued here that have not started, in the order they
        were placed."""
        return list(itertools.islice(self._unstarted, limit))

    def own_backlog(self, request_id: str) -> int:
        return self._unstarted.get(request_id, 0)

    @property
    def imports_snapshots(self) -> bool:
        """Ready, and its executor can stage a snapshot another executor exported."""
        return (
            self.accepts_work
            and self.info is not None
            and self.info.snapshot_migration
            and isinstance(self._session, ImportsSnapshots)
        )

    def host_room_for(self, num_pages: int) -> bool:
        return self.scheduler is not None and self.scheduler.host_room_for(num_pages)

    # -------------------------------------------------------------------------- requests
    async def stage_snapshot(
        self, source_endpoint: str, ticket: str, request_id: str, num_pages: int
    ) -> SnapshotStaged:
        """Have this executor fetch and stage a migrating request's KV (``place`` with the
        snapshot follows); raises :class:`TransferError` when it cannot take it."""
        session = self._session
        if not self.imports_snapshots or not isinstance(session, ImportsSnapshots):
            raise TransferError(TransferFailure.NO_RECEIVER, f"{self.name} takes no snapshots")
        if not self.host_room_for(num_pages):
            raise TransferError(
                TransferFailure.NO_HOST_ROOM, f"{self.name}: no host room for {num_pages} pages"
            )
        sessions = self.sessions
        staged = await session.import_snapshot(
            source_endpoint, ticket, request_id, self._settings.migration_timeout_s
        )
        if self.sessions != sessions or not self.accepts_work:
            raise TransferError(
                TransferFailure.RECEIVER_LOST, f"{self.name}'s session changed during the transfer"
            )
        return staged

    def place(
        self,
        spec: RequestSpec,
        *,
        arrival_seq: int,
        progress: RequestProgress | None,
        snapshot: ImportedSnapshot | None = None,
    ) -> tuple[RejectCode, str] | None:
        """Queue a request on this executor's scheduler and reserve its full-length need; the
        reason when it cannot run here. Only a ready handle takes work."""
        scheduler, info = self.scheduler, self.info
        assert scheduler is not None and info is not None
        prompt = spec.prompt_token_ids
        sampling = spec.sampling
        # The prompt's, logit_bias's and stop_token_ids' ids alike (the executor would refuse
        # the whole step that registers one beyond its vocabulary).
        largest = max([*prompt, *sampling.logit_bias, *sampling.stop_token_ids])
        if largest >= info.vocab_size:
            return (
                RejectCode.TOKEN_OUT_OF_VOCABULARY,
                f"token id {largest} is outside the model's vocabulary ({info.vocab_size})",
            )
        if sampling.grammar is not None and not info.structured_outputs:
            return (
                RejectCode.STRUCTURED_OUTPUT,
                f"{self.name} cannot enforce a structured output or a forced tool call (its "
                "model has no tokenizer or no end-of-sequence token)",
            )
        try:
            scheduler.add_request(
                spec,
                arrival_seq=arrival_seq,
                progress=progress,
                snapshot=snapshot,
                now=self._clock(),
            )
        except RequestRejected as exc:
            return RejectCode.INFEASIBLE, f"{self.name}: {exc.reason}"
        blocks = capacity.blocks_for(
            len(prompt),
            spec.sampling.max_tokens,
            block_size=info.block_size,
            num_planes=info.num_loops,
        )
        self._reserved[spec.request_id] = blocks
        self.reserved_blocks += blocks
        if snapshot is None:
            fill = len(prompt) + (len(progress.output_token_ids) if progress is not None else 0)
            self._unstarted[spec.request_id] = fill
            self.backlog_tokens += fill
        self.wake()
        return None

    def release(self, request_id: str) -> None:
        """The request left this executor (answered, handed off or moved): free its reservation."""
        self.reserved_blocks -= self._reserved.pop(request_id, 0)
        self._started(request_id)

    def withdraw(self, request_id: str) -> RequestProgress | None:
        """Lift out a request queued here that has not started, to be placed elsewhere with its
        place kept (``Scheduler.withdraw``); ``None`` when it has started (or is not here)."""
        scheduler = self.scheduler
        progress = scheduler.withdraw(request_id) if scheduler is not None else None
        if progress is not None:
            self.release(request_id)
        return progress

    def _started(self, request_id: str) -> None:
        self.backlog_tokens -= self._unstarted.pop(request_id, 0)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Finish a request queued or running here (cancelled, or ``stop`` on a stop string);
        its events reach the observer at once. False when this executor does not hold it."""
        scheduler = self.scheduler
        if scheduler is None or not scheduler.abort(request_id, reason):
            return False
        self._observer.on_events(self, scheduler.pop_events())
        self.wake()
        return True

    def status(self) -> ExecutorStatus:
        scheduler = self.scheduler
        total = self.info.num_blocks if self.info is not None else 0
        free = scheduler.state.pool.num_free_blocks if scheduler is not None else total
        return ExecutorStatus(
            name=self.name,
            endpoint=self.spec.endpoint,
            state=self.state,
            running_requests=scheduler.num_running if scheduler is not None else 0,
            waiting_requests=scheduler.num_waiting if scheduler is not None else 0,
            kv_blocks_used=total - free,
            kv_blocks_total=total,
        )

    # ---------------------------------------------------------------------------- control
    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"kvgate-executor-{self.name}")

    def wake(self) -> None:
        self._wake.set()

    def set_draining(self, draining: bool) -> None:
        self.draining = draining
        self._wake.set()

    def request_evacuation(self) -> None:
        """Lift every request out at the next quiescent point (draining with somewhere to go)."""
        self._evacuate = True
        self._wake.set()

    async def stop(self) -> None:
        """Leave: hand every request back to the engine (lifted) and close the session."""
        self._stop.set()
        self._wake.set()
        if self._task is not None:
            await self._task

    # ----------------------------------------------------------------------- supervision
    async def _supervise(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                session = await self._connector(self.spec.endpoint, self._epochs.next())
            except (ConnectFailed, SessionRefused) as exc:
                self.lost_reason = self.lost_reason or f"not connected: {exc}"
                delay_s = self._reconnect_delay_s(failures)
                failures += 1
                # Loud on the first failure and then every tenth: an executor that is still
                # loading its model refuses connections for a while.
                level = logging.WARNING if failures % 10 == 1 else logging.DEBUG
                log.log(level, "executor %s: %s; retrying in %.1f s", self.name, exc, delay_s)
                await self._pause(delay_s)
                continue
            failures = 0
            failure = await self._serve(session)
            with contextlib.suppress(Exception):
                await session.close()
            if failure is None:
                return
            if failure.fenced:
                # A newer admission session owns the executor now: do not fight over it.
                await self._pause(self._reconnect_delay_s(_FENCED_RETRY))

    def _reconnect_delay_s(self, retry: int) -> float:
        settings = self._settings
        return jittered_delay_s(
            retry, initial_s=settings.reconnect_initial_s, max_s=settings.reconnect_max_s
        )

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _serve(self, session: StepSession) -> SessionLost | None:
        self.info = session.info
        self._session = session
        self.scheduler = scheduler_for(
            session.info, self._config, self._settings.enable_prefix_caching
        )
        self.connected = True
        self.lost_reason = None
        self.reported = ExecutorCounters()  # accepting the epoch reset the executor
        self.sessions += 1
        self._evacuate = False
        self._reserved.clear()  # everything placed before was lifted when the last session ended
        self.reserved_blocks = 0
        self._unstarted.clear()
        self.backlog_tokens = 0
        self._observer.on_ready(self)
        loop = asyncio.create_task(self._step_loop(session), name=f"kvgate-steps-{self.name}")
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait({loop, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not loop.done():
            # Leaving: no need to wait for plans in flight — the session closes, and the
            # executor resets when a session opens again. Cancelling at an await point leaves
            # the scheduler consistent (between schedule/send or awaiting a result).
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
            self._retire(None)
            return None
        try:
            loop.result()
        except (SessionLost, PlanRejected, SchedulerStalled) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.error("executor %s lost: %s", self.name, reason)
            self._retire(reason)
            return exc if isinstance(exc, SessionLost) else SessionLost(reason)
        except Exception as exc:  # a bug here must not leave requests stranded on this handle
            reason = f"internal error: {exc!r}"
            log.exception("executor %s: step loop failed", self.name)
            self._retire(reason)
            return SessionLost(reason)
        self._retire(None)
        return None

    def _retire(self, failure: str | None) -> None:
        """The session is over: every request goes back to the engine (to resume elsewhere by
        recompute); ``failure`` says why when the session broke."""
        scheduler = self.scheduler
        self.connected = False
        self.lost_reason = failure
        self.scheduler = None
        self._session = None
        self.reported = None
        if scheduler is not None:
            lifted = scheduler.evacuate(executor_alive=False)
            self._observer.on_events(self, scheduler.pop_events())
            self._hand_back(lifted, failure)

    # ------------------------------------------------------------------------- step loop
    async def _step_loop(self, session: StepSession) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        allowed = 2 if scheduler.config.async_scheduling else 1
        inflight: deque[tuple[StepPlan, float]] = deque()
        observer = self._observer
        while True:
            if not inflight and self._evacuate:
                self._evacuate = False
                await self._lift(scheduler, session)
            while len(inflight) < allowed and scheduler.has_work and not self._evacuate:
                plan = scheduler.schedule(self._clock())
                for request_id, _ in scheduler.last_report.admitted:
                    self._started(request_id)
                events = scheduler.pop_events()
                if events:
                    observer.on_events(self, events)
                if plan is None:
                    break
                plan = observer.before_send(self, plan, scheduler.last_report)
                await session.send(plan)
                inflight.append((plan, time.perf_counter()))
            if inflight:
                result = await session.receive()
                self.reported = result.counters
                plan, sent_at = inflight.popleft()
                events = scheduler.apply(result)
                observer.after_apply(self, plan, result, time.perf_counter() - sent_at)
                if events:
                    observer.on_events(self, events)
                continue
            await self._idle(session, poll=scheduler.has_work)

    async def _idle(self, session: StepSession, *, poll: bool) -> None:
        """Wait for new work, a control request, or the session breaking (then raise)."""
        self._wake.clear()
        if self._evacuate:
            return
        woken = asyncio.ensure_future(self._wake.wait())
        lost = asyncio.ensure_future(session.wait_lost())
        try:
            await asyncio.wait(
                {woken, lost},
                timeout=_IDLE_POLL_S if poll else None,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            woken.cancel()
            lost.cancel()
        if lost.done() and not lost.cancelled():
            raise lost.result()

    async def _lift(self, scheduler: Scheduler, session: StepSession) -> None:
        """Hand every request back to the engine; the next plan frees them on the executor, or
        (migration) exports their KV: that plan is sent and applied first, so the tickets the
        engine gets are valid. If it fails, they are handed back to resume by recompute."""
        info = self.info
        migrate = self._settings.migrate_on_drain and info is not None and info.snapshot_migration
        tickets = (
            {rid: secrets.token_urlsafe(24) for rid in scheduler.migratable()} if migrate else {}
        )
        lifted = scheduler.evacuate(
            executor_alive=True, exports=tickets, export_ttl_s=self._settings.export_ttl_s
        )
        if not lifted:
            return
        if tickets:
            try:
                await self._send_exports(scheduler, session)
            except BaseException:
                self._hand_back([dataclasses.replace(p, snapshot_pages=0) for p in lifted], None)
                raise
        self._hand_back(lifted, None, tickets if migrate else None)

    async def _send_exports(self, scheduler: Scheduler, session: StepSession) -> None:
        plan = scheduler.schedule(self._clock())
        assert plan is not None, "an export is always planned"
        plan = self._observer.before_send(self, plan, scheduler.last_report)
        sent_at = time.perf_counter()
        await session.send(plan)
        result = await session.receive()
        self.reported = result.counters
        scheduler.apply(result)  # raises PlanRejected when the executor refused the exports
        self._observer.after_apply(self, plan, result, time.perf_counter() - sent_at)

    def _hand_back(
        self,
        lifted: list[RequestProgress],
        failure: str | None,
        tickets: Mapping[str, str] | None = None,
    ) -> None:
        for progress in lifted:
            self.release(progress.spec.request_id)
        self._observer.on_lifted(self, lifted, failure, tickets)
