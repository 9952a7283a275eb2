"""The engine: requests in, placement over executors, results out.

One :class:`ExecutorHandle` (scheduler + step loop) per executor. A new request goes where
its prompt is cached, balanced against the work queued there (``placement.py``: the scoring
rule, the bound on imbalance, affinity keys), or — ``placement.policy: headroom`` — to the
ready executor with the most free KV capacity. A request that waits on its executor without
having started may move to an executor that frees up or joins (``placement.pull``), keeping its
arrival number and bypass count. Requests with nowhere to go (no executor ready yet) wait
unplaced, in arrival order. Each request is charged to its tenant's quota when it is read
(``quotas.py``).

Every request gets a global ``arrival_seq`` when it is read, so a request that moves between
executors (executor lost, drained or removed) keeps its place in admission order; it resumes by
recompute from what it had generated (``Scheduler.evacuate`` / ``add_request(progress=...)``)
and produces the same outputs. A request lifted from a draining executor with its KV exported
(migration) moves with it: the most-headroom ready executor that takes snapshots and has host
room fetches and stages it, and it waits there as preempted with a host snapshot; any failure
falls back to recompute. Each attempt is counted (``kvgate_admission_migrations_total
{outcome}``) and recorded on the request span.

The engine is the registry of requests read and not answered, and the placement policy over
executor handles; each handle owns its scheduler, the requests placed on it and their KV
reservation. What an answer contains and where it goes is :class:`~answers.Answers`' business
(results, dead letters, token chunks to an :class:`~answers.OutcomeSink`, which owns delivery:
see ``outbox.py``); aborts that overtake their request are kept by :class:`~aborts.AbortMemory`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from kvgate.admission_service.aborts import AbortMemory
from kvgate.admission_service.answers import Answers, OutcomeSink
from kvgate.admission_service.choices import ChoiceGroup, assemble, choice_spec
from kvgate.admission_service.executor_client import Connector, EpochClock
from kvgate.admission_service.executor_handle import ExecutorHandle, SessionSettings
from kvgate.admission_service.idempotency import AnsweredIds
from kvgate.admission_service.membership import Membership
from kvgate.admission_service.metrics import ExecutorGauge, ServiceMetrics
from kvgate.admission_service.placement import (
    Ask,
    ExecutorView,
    PlacementSettings,
    Placer,
    pull,
)
from kvgate.admission_service.quotas import Quotas
from kvgate.admission_service.stops import find_stop, stop_window_tokens
from kvgate.admission_service.tokenizer import TextCodec
from kvgate.admission_service.tracing import ServiceTracer, traceparent_of_span
from kvgate.admission_service.tracking import (
    Tracked,
    output_logprobs,
    text_of,
)
from kvgate.admission_service.validation import Accepted, RawRecord, Rejection, build_spec
from kvgate.protocol.admin import ExecutorSpec, ExecutorStatus
from kvgate.protocol.enums import FinishReason
from kvgate.protocol.migration import TransferError, TransferFailure
from kvgate.protocol.records import RejectCode, ResultStatus, SourceRef
from kvgate.protocol.step import StepPlan, StepResult
from kvgate.protocol.tenants import DEFAULT_TENANT, TenantsSettings
from kvgate.scheduler.config import SchedulerConfig
from kvgate.scheduler.events import (
    FinishedEvent,
    PromptLogprobsEvent,
    RequestEvent,
    StepReport,
    TokenEvent,
)
from kvgate.scheduler.request import ImportedSnapshot, RequestProgress

log = logging.getLogger(__name__)

MIGRATION_TRANSFERS = 2


@dataclass(frozen=True, slots=True)
class StepSample:
    """One applied step, for timelines (the demo's plot)."""

    at_s: float
    executor: str
    step_id: int
    waiting: int
    running: int
    kv_blocks_used: int
    preemptions: int


@dataclass(frozen=True, slots=True)
class EngineSettings:
    scheduler: SchedulerConfig
    session: SessionSettings
    max_request_failures: int = 3
    token_stream: bool = False
    abort_memory_s: float = 600.0
    timeline_steps: int = 0  # keep this many StepSamples (0: none)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    tenants: TenantsSettings = field(default_factory=TenantsSettings)


class Engine:
    def __init__(
        self,
        settings: EngineSettings,
        *,
        connector: Connector,
        sink: OutcomeSink,
        tracer: ServiceTracer,
        metrics: ServiceMetrics,
        tokenizer: TextCodec | None = None,
        epochs: EpochClock | None = None,
        clock: Callable[[], float] = time.monotonic,
        answered: AnsweredIds | None = None,
    ) -> None:
        self.settings = settings
        self._tracer = tracer
        self.metrics = metrics
        self._clock = clock
        self._tokenizer = tokenizer  # stop strings are found in the decoded text
        # One answer per id (idempotency.py): ids answered within the window.
        self.answered = AnsweredIds(600.0, 200_000) if answered is None else answered
        self._answers = Answers(
            sink,
            tracer=tracer,
            metrics=metrics,
            clock=clock,
            answered=self.answered,
            tokenizer=tokenizer,
        )
        self._aborted = AbortMemory(settings.abort_memory_s, clock)
        self._placer = Placer(settings.placement)
        self._quotas = Quotas(settings.tenants)
        self.members = Membership(
            connector=connector,
            epochs=epochs or EpochClock(),
            scheduler=settings.scheduler,
            session=settings.session,
            observer=self,
        )
        self._requests: dict[str, Tracked] = {}
        self._unplaced: list[tuple[int, str]] = []  # heap of (arrival_seq, request id)
        self._num_unplaced = 0
        self._migrations: set[asyncio.Task[None]] = set()  # requests moving with their KV
        # Transfers at once (each receiver stages at most a few: more would be refused busy).
        self._transfer_slots = asyncio.Semaphore(MIGRATION_TRANSFERS)
        self._next_seq = 0
        self._step_spans: dict[tuple[str, int], Span] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.timeline: deque[StepSample] = deque(maxlen=settings.timeline_steps or None)
        self._started_at = clock()

    # ---------------------------------------------------------------------------- views
    @property
    def num_tracked(self) -> int:
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        """Requests read and not running: unplaced, or queued in an executor's scheduler."""
        return self._num_unplaced + len(self._migrations) + self.members.num_waiting

    @property
    def num_running(self) -> int:
        return self.members.num_running

    @property
    def num_unplaced(self) -> int:
        return self._num_unplaced

    def executor_gauges(self) -> list[ExecutorGauge]:
        return self.members.gauges()

    async def wait_idle(self) -> None:
        """Returns once no request read by this service is unanswered."""
        await self._idle.wait()

    # ----------------------------------------------------------------------- membership
    @property
    def handles(self) -> dict[str, ExecutorHandle]:
        return self.members.handles

    async def set_members(self, specs: list[ExecutorSpec]) -> None:
        await self.members.set(specs)

    def drain(self, name: str) -> ExecutorStatus | None:
        return self.members.drain(name)

    async def close(self, timeout_s: float | None = None) -> None:
        """Leave every executor (all at once, within ``timeout_s``: an executor that does not
        answer the close handshake in time is left anyway); requests not finished are handed
        off (left unanswered)."""
        for task in list(self._migrations):
            task.cancel()
        leaving = asyncio.ensure_future(self.members.close())
        try:
            await asyncio.wait_for(asyncio.shield(leaving), timeout_s)
        except TimeoutError:
            log.warning("leaving the executors took over %.1f s: handing off anyway", timeout_s)
        for tracked in list(self._requests.values()):
            self._hand_off(tracked)

    # ------------------------------------------------------------------------- requests
    def submit(self, record: RawRecord, accepted: Accepted) -> None:
        """Queue a validated request (or answer it at once: duplicate, aborted earlier)."""
        request = accepted.request
        # Fields already typed by the consumer: no validation needed on this hot path.
        source = SourceRef.model_construct(
            topic=record.topic, partition=record.partition, offset=record.offset
        )
        rid = request.request_id
        if rid in self._requests or rid in self.answered:
            reason = (
                "a request with this id is already in flight"
                if rid in self._requests
                else "a request with this id was already answered"
            )
            self._answers.rejected_record(
                record, Rejection(RejectCode.DUPLICATE, reason, rid), in_flight=True
            )
            return
        span = self._tracer.start_request(request, source, record.traceparent)
        spec = build_spec(accepted, traceparent_of_span(span))
        if request.tenant is not None:
            spec = dataclasses.replace(spec, tenant=request.tenant)
        # One arrival number per choice, taken now: choices placed later keep their place.
        arrival_seq = self._next_seq + 1
        self._next_seq += request.n
        tracked = Tracked(request, spec, source, arrival_seq, self._clock(), span, record)
        if request.n > 1:
            tracked.group = ChoiceGroup(request.n, members={0: tracked})
        self._requests[rid] = tracked
        self._idle.clear()
        if self._aborted.take(rid):
            self._answer(
                tracked, ResultStatus.ABORTED, "aborted before it was read", FinishReason.ABORT
            )
            return
        cost = len(spec.prompt_token_ids) + request.n * spec.sampling.max_tokens
        wait_s = self._quotas.take(spec.tenant, cost, self._clock())
        if wait_s is not None:
            quota = self._quotas.quota(spec.tenant)
            assert quota is not None
            self._release(tracked)
            self._answers.rejected(
                tracked,
                RejectCode.QUOTA_EXCEEDED,
                f"tenant {spec.tenant or DEFAULT_TENANT} is over its quota of "
                f"{quota.tokens_per_minute} tokens per minute ({cost} asked); retry in "
                f"{wait_s:.1f} s",
            )
            return
        self._place(tracked)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; returns whether it was in flight here (else it is remembered)."""
        self.metrics.aborts.inc()
        tracked = self._requests.get(request_id)
        if tracked is None:
            self._aborted.remember(request_id)
            return False
        if tracked.group is not None:  # every choice at once, one answer
            self._answer(tracked, ResultStatus.ABORTED, "aborted", FinishReason.ABORT)
            return True
        handle = self._handle_of(tracked)
        if handle is None or not handle.abort(request_id):
            self._answer(tracked, ResultStatus.ABORTED, "aborted while waiting", FinishReason.ABORT)
        return True

    def drop_partition(self, topic: str, partition: int) -> int:
        """Hand off every request read from a revoked partition: it is cancelled here without
        an answer, so its offset stays uncommitted and the partition's next owner runs it."""
        dropped = [
            t
            for t in self._requests.values()
            if (t.source.topic, t.source.partition) == (topic, partition)
        ]
        for tracked in dropped:
            tracked.handed_off = True  # its abort's FinishedEvent hands it off (on_events)
            handle = self._handle_of(tracked)
            if handle is None or not handle.abort(tracked.request_id):
                self._hand_off(tracked)
        return len(dropped)

    def _handle_of(self, tracked: Tracked) -> ExecutorHandle | None:
        return self.handles.get(tracked.executor) if tracked.executor else None

    # ------------------------------------------------------------------------ placement
    def _place(self, tracked: Tracked, prefer: str | None = None) -> None:
        """Queue ``tracked`` where placement ranks it best (``prefer`` first: a request's other
        choices go where its prompt is cached)."""
        ready = self.members.ready()
        by_name = {handle.name: handle for handle in ready}
        candidates = [by_name[view.name] for view in self._placer.rank(_ask(tracked), ready)]
        if prefer is not None:
            candidates = sorted(candidates, key=lambda handle: handle.name != prefer)
        if not candidates:
            tracked.executor = None
            tracked.unplaced = True
            heapq.heappush(self._unplaced, (tracked.arrival_seq, tracked.request_id))
            self._num_unplaced += 1
            return
        problems: list[tuple[RejectCode, str]] = []
        for handle in candidates:
            problem = self._try_place(tracked, handle)
            if problem is None:
                return
            problems.append(problem)
        code, reason = problems[0]
        if tracked.progress is None and tracked.record is not None:
            self._release(tracked)
            self._answers.rejected(tracked, code, reason)
        else:
            self._answer(
                tracked, ResultStatus.FAILED, f"cannot resume after its executor left: {reason}"
            )

    def _try_place(self, tracked: Tracked, handle: ExecutorHandle) -> tuple[RejectCode, str] | None:
        problem = handle.place(
            tracked.spec, arrival_seq=tracked.arrival_seq, progress=tracked.progress
        )
        if problem is not None:
            return problem
        tracked.executor = handle.name
        tracked.executors.append(handle.name)
        tracked.record = None
        tracked.progress = None
        self._placer.placed(_ask(tracked), handle)
        return None

    def _pull_into(self, target: ExecutorHandle) -> None:
        """``target`` has nothing waiting: requests waiting unstarted elsewhere that would cost
        less there by the margin move to it, oldest first, as many as it has free slots."""
        scheduler = target.scheduler
        if scheduler is None or not target.accepts_work or scheduler.num_waiting > 0:
            return
        budget = scheduler.config.max_num_seqs - scheduler.num_running
        if budget <= 0:
            return
        queued: list[tuple[ExecutorView, Ask, int]] = []
        for source in self.members.ready():
            if source is target:
                continue
            for rid in source.unstarted(4 * budget):
                tracked = self._requests.get(rid)
                if tracked is not None and tracked.executor == source.name:
                    queued.append((source, _ask(tracked), source.own_backlog(rid)))
        if not queued:
            return
        queued.sort(key=lambda item: self._requests[item[1].request_id].arrival_seq)
        pull(self._placer, target, queued, budget, self._move)

    def _move(self, ask: Ask, source: ExecutorView, target: ExecutorView) -> bool:
        assert isinstance(source, ExecutorHandle) and isinstance(target, ExecutorHandle)
        tracked = self._requests[ask.request_id]
        progress = source.withdraw(ask.request_id)
        if progress is None:
            return False  # it started meanwhile
        self._placer.left(ask.request_id, ask.affinity_key)
        problem = target.place(tracked.spec, arrival_seq=tracked.arrival_seq, progress=progress)
        if problem is not None:  # it cannot run there after all: back where it was
            problem = source.place(tracked.spec, arrival_seq=tracked.arrival_seq, progress=progress)
            assert problem is None, f"{ask.request_id} ran on {source.name} a moment ago"
            self._placer.placed(ask, source)
            return False
        tracked.executor = target.name
        tracked.executors.append(target.name)
        tracked.moves += 1
        self._placer.placed(ask, target)
        self.metrics.placement_moves.inc()
        return True

    def _place_unplaced(self) -> None:
        while self._unplaced and self.members.ready():
            _, rid = heapq.heappop(self._unplaced)
            tracked = self._requests.get(rid)
            if tracked is None or not tracked.unplaced:
                continue  # answered meanwhile (lazy deletion)
            tracked.unplaced = False
            self._num_unplaced -= 1
            self._place(tracked)

    # ------------------------------------------------------------------ pool observer
    def on_ready(self, handle: ExecutorHandle) -> None:
        self._place_unplaced()
        self.members.evacuate_drains()
        self._pull_into(handle)

    def on_events(self, handle: ExecutorHandle, events: list[RequestEvent]) -> None:
        requests = self._requests
        token_stream = self.settings.token_stream
        now = self._clock()  # the events of one step's result arrive together
        streamed: list[tuple[Tracked, TokenEvent]] = []  # streamed once the step is read
        gaps: list[float] = []  # since each request's previous token
        for event in events:
            tracked = requests.get(event.request_id)
            if tracked is None or tracked.executor != handle.name:
                continue  # an event of a request that has moved on
            if isinstance(event, TokenEvent):
                if tracked.first_token_at is None:
                    tracked.first_token_at = now
                    self.metrics.observe_first_token(handle.name, now - tracked.received_at)
                    group = tracked.group
                    if group is not None and not group.spawned:
                        self._spawn_choices(tracked, group)
                elif tracked.last_token_at is not None:
                    gaps.append(now - tracked.last_token_at)
                tracked.last_token_at = now
                if event.logprob is not None and event.output_index == len(tracked.logprobs):
                    tracked.logprobs.append(output_logprobs(event, self._tokenizer))
                if tracked.request.stop and self._tokenizer is not None:
                    self._stop_on_text(handle, tracked, event)
                reply = tracked.request.reply
                if (
                    (token_stream or (reply is not None and reply.tokens))
                    and not tracked.handed_off
                    and event.output_index >= tracked.tokens_out
                ):
                    tracked.tokens_out = event.output_index + 1
                    streamed.append((tracked, event))
            elif isinstance(event, PromptLogprobsEvent):
                scores = event.logprobs
                tops = scores.top_logprobs or [[] for _ in scores.logprobs]
                for offset, (logprob, top) in enumerate(zip(scores.logprobs, tops, strict=True)):
                    tracked.prompt_scores[scores.first_position + offset] = (logprob, top)
            elif isinstance(event, FinishedEvent):
                unused = tracked.spec.sampling.max_tokens - len(event.output_token_ids)
                self._quotas.credit(tracked.spec.tenant, unused, now)
                admitted = tracked.admitted_at
                self.metrics.observe_finished(
                    handle.name,
                    now - tracked.received_at,
                    None if admitted is None else admitted - tracked.received_at,
                )
                if tracked.handed_off:
                    self._hand_off(tracked)
                    continue
                self._release(tracked)
                if tracked.group is None:
                    self._answers.finished(tracked, event)
                else:
                    self._choice_finished(tracked, tracked.group, event)
        if gaps:
            self.metrics.observe_token_gaps(handle.name, gaps)
        if streamed:
            self._answers.tokens(streamed)

    # ---------------------------------------------------------------------- n > 1 choices
    def _spawn_choices(self, leader: Tracked, group: ChoiceGroup) -> None:
        """Place choices 1..n-1 beside choice 0, whose prompt is now in the prefix cache."""
        group.spawned = True
        for index in range(1, group.n):
            spec = choice_spec(leader.spec, index)
            member = Tracked(
                leader.request, spec, leader.source, leader.arrival_seq + index,
                leader.received_at, leader.span, None, choice=index, group=group,
            )  # fmt: skip
            group.members[index] = member
            self._requests[spec.request_id] = member
            self._place(member, prefer=leader.executor)
            if self._requests.get(leader.request_id) is not leader:
                return  # a choice that could not be placed failed the request

    def _choice_finished(self, tracked: Tracked, group: ChoiceGroup, event: FinishedEvent) -> None:
        group.results[tracked.choice] = self._answers.finished_result(tracked, event)
        if group.complete:
            leader = group.leader
            self._answers.deliver(leader, assemble(leader.request_id, group))

    def _stop_on_text(self, handle: ExecutorHandle, tracked: Tracked, event: TokenEvent) -> None:
        """Finish the request (reason stop) once its text holds one of its stop strings."""
        assert self._tokenizer is not None
        if tracked.stop_text is not None:
            return
        if event.output_index != len(tracked.output_token_ids):
            return  # not a new token (every output arrives once, in order)
        outputs = tracked.output_token_ids
        outputs.append(event.token_id)
        stops = tracked.request.stop
        # A stop completed by this token lies in the last few tokens: decode only those on
        # every token (this runs on the service's event loop), the whole text once it matches.
        tail = text_of(self._tokenizer, outputs[-stop_window_tokens(stops) :])
        if tail is None or find_stop(tail, stops) is None:
            return  # no text (a pool whose model has no tokenizer): nothing to stop on
        text = self._tokenizer.decode(outputs)
        cut = find_stop(text, stops)
        if cut is not None:
            tracked.stop_text = text[:cut]
            handle.abort(tracked.request_id, FinishReason.STOP)

    def on_lifted(
        self,
        handle: ExecutorHandle,
        lifted: list[RequestProgress],
        failure: str | None,
        tickets: Mapping[str, str] | None = None,
    ) -> None:
        if failure is not None:
            self.metrics.executor_losses.labels(executor=handle.name).inc()
        limit = self.settings.max_request_failures
        for progress in lifted:
            tracked = self._requests.get(progress.spec.request_id)
            if tracked is None or tracked.executor != handle.name:
                continue
            tracked.executor = None
            tracked.progress = progress
            if failure is not None:
                tracked.failures += 1
                if tracked.failures >= limit:
                    reason = (
                        f"{tracked.failures} executors failed while running it (last: {failure})"
                    )
                    self._answer(tracked, ResultStatus.FAILED, reason)
                    continue
            if tickets is not None:
                ticket = tickets.get(tracked.request_id)
                if ticket is not None and progress.snapshot_pages:
                    self._start_migration(tracked, handle, ticket)
                    continue
                # A drain that could not export it: nothing to move, or not at a token boundary.
                outcome = "not_migratable" if progress.kv_tokens else "no_kv"
                self.metrics.migrations.labels(outcome=outcome).inc()
                self._tracer.migration(
                    tracked.span, outcome=outcome, source=handle.name, target=None,
                    detail="", payload_bytes=0, seconds=0.0,
                )  # fmt: skip
            self._place(tracked)

    # ------------------------------------------------------------------------ migration
    def _start_migration(self, tracked: Tracked, source: ExecutorHandle, ticket: str) -> None:
        task = asyncio.create_task(
            self._migrate(tracked, source, ticket), name=f"kvgate-migrate-{tracked.request_id}"
        )
        self._migrations.add(task)
        task.add_done_callback(self._migrations.discard)

    def _migration_target(self, num_pages: int) -> ExecutorHandle:
        takers = [h for h in self.members.ready() if h.imports_snapshots]
        if not takers:
            raise TransferError(TransferFailure.NO_RECEIVER, "no ready executor takes snapshots")
        for handle in takers:  # most headroom first
            if handle.host_room_for(num_pages):
                return handle
        raise TransferError(
            TransferFailure.NO_HOST_ROOM, f"no ready executor has host room for {num_pages} pages"
        )

    async def _migrate(self, tracked: Tracked, source: ExecutorHandle, ticket: str) -> None:
        """Move a lifted request with its exported KV; on any failure it resumes by recompute.
        It stays in the registry meanwhile (an abort or a revoked partition answers it)."""
        progress = tracked.progress
        assert progress is not None
        began = self._clock()
        rid = tracked.request_id
        outcome, detail, size = "migrated", "", 0
        target: ExecutorHandle | None = None
        try:
            async with self._transfer_slots:
                if self._requests.get(rid) is not tracked or tracked.handed_off:
                    outcome = "abandoned"
                    return
                target = self._migration_target(progress.snapshot_pages)
                staged = await target.stage_snapshot(
                    source.spec.endpoint, ticket, rid, progress.snapshot_pages
                )
            size = staged.payload_bytes
            if self._requests.get(rid) is not tracked or tracked.handed_off:
                outcome = "abandoned"  # answered or handed off meanwhile; the staging expires
                return
            problem = target.place(
                tracked.spec,
                arrival_seq=tracked.arrival_seq,
                progress=progress,
                snapshot=ImportedSnapshot(ticket=ticket, num_pages=staged.num_pages),
            )
            if problem is not None:
                raise TransferError(TransferFailure.NO_HOST_ROOM, problem[1])
            tracked.executor = target.name
            tracked.executors.append(target.name)
            tracked.progress = None
        except TransferError as exc:
            outcome, detail = exc.failure.value, exc.message
            log.warning("migrating %s from %s: %s; it resumes by recompute", rid, source.name, exc)
        except Exception as exc:  # a defect, never a lost request: it resumes by recompute
            outcome, detail = "error", repr(exc)
            log.exception("migrating %s from %s failed; it resumes by recompute", rid, source.name)
        finally:
            seconds = self._clock() - began
            self.metrics.migrations.labels(outcome=outcome).inc()
            if outcome == "migrated":
                self.metrics.migrated_bytes.inc(size)
                self.metrics.migration_seconds.observe(seconds)
            self._tracer.migration(
                tracked.span, outcome=outcome, source=source.name,
                target=target.name if target is not None else None, detail=detail,
                payload_bytes=size, seconds=seconds,
            )  # fmt: skip
        if outcome != "migrated" and self._requests.get(rid) is tracked and not tracked.handed_off:
            tracked.progress = dataclasses.replace(progress, snapshot_pages=0)
            self._place(tracked)

    def before_send(self, handle: ExecutorHandle, plan: StepPlan, report: StepReport) -> StepPlan:
        now = self._clock()
        links: list[Span] = []
        for request_id, _kind in report.admitted:
            tracked = self._requests.get(request_id)
            if tracked is not None:
                links.append(tracked.span)
                if tracked.admitted_at is None:
                    tracked.admitted_at = now
        self.metrics.observe_step(report, handle.name)
        span = self._tracer.start_step(handle.name, plan, report, links)
        traceparent = traceparent_of_span(span)
        self._step_spans[(handle.name, plan.step_id)] = span
        if self.timeline.maxlen:
            self.timeline.append(
                StepSample(
                    now - self._started_at, handle.name, plan.step_id, report.num_waiting,
                    report.num_running, report.blocks_used, len(report.preemptions),
                )
            )  # fmt: skip
        return plan if traceparent is None else plan.model_copy(update={"traceparent": traceparent})

    def after_apply(
        self, handle: ExecutorHandle, plan: StepPlan, result: StepResult, round_trip_s: float
    ) -> None:
        span = self._step_spans.pop((handle.name, plan.step_id), None)
        if span is not None:
            self._tracer.end_step(span, result, round_trip_s)
        self.metrics.steps.labels(executor=handle.name).inc()
        self.metrics.step_round_trip.observe(round_trip_s)
        scheduler = handle.scheduler
        if self._placer.settings.max_moves and scheduler is not None and not scheduler.num_waiting:
            self._pull_into(handle)

    # ------------------------------------------------------------------------- answers
    def _release(self, tracked: Tracked) -> None:
        """Forget a request (about to be answered, or handed off)."""
        self._requests.pop(tracked.request_id, None)
        self._placer.left(tracked.request_id, tracked.request.affinity_key)
        if tracked.unplaced:
            tracked.unplaced = False  # its heap entry is skipped when popped
            self._num_unplaced -= 1
        elif (handle := self._handle_of(tracked)) is not None:
            handle.release(tracked.request_id)
        if not self._requests:
            self._idle.set()

    def _answer(
        self,
        tracked: Tracked,
        status: ResultStatus,
        reason: str,
        finish: FinishReason | None = None,
    ) -> None:
        group = tracked.group
        if group is not None:
            # One choice aborted, failed or rejected: the request is answered, its other
            # choices are cancelled where they run and forgotten.
            for member in group.members.values():
                if self._requests.get(member.request_id) is member:
                    # Forgotten first: the abort's FinishedEvent (maybe at once) is then ignored.
                    self._release(member)
                    handle = self._handle_of(member)
                    if handle is not None:
                        handle.abort(member.request_id)
            tracked = group.leader
        else:
            self._release(tracked)
        self._answers.unfinished(tracked, status, reason, finish)

    def _hand_off(self, tracked: Tracked) -> None:
        tracked.handed_off = True
        self._release(tracked)
        group = tracked.group
        if group is not None:
            if group.handed_off:
                return  # the request's span said so already
            group.handed_off = True
            tracked = group.leader
        self._answers.handed_off(tracked)

    def reject(self, record: RawRecord, rejection: Rejection) -> None:
        """A record that failed validation: dead letter, and a result when the id is known and
        has no answer yet (nor one coming from a copy in flight)."""
        in_flight = rejection.request_id is not None and rejection.request_id in self._requests
        self._answers.rejected_record(record, rejection, in_flight=in_flight)


def _ask(tracked: Tracked) -> Ask:
    spec = tracked.spec
    return Ask(
        spec.request_id,
        spec.prompt_token_ids,
        spec.sampling.max_tokens,
        tracked.request.affinity_key,
        tracked.moves,
    )
