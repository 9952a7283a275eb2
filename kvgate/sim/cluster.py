"""Several executors behind one placement rule, in simulated time: the admission service's
placement, re-placement and per-executor scheduling without Kafka or sockets.

Each node is a scheduler and an executor (``SimExecutor`` for exact outputs, or the fast
``CountingExecutor``). Nodes run their steps back to back while they have work, each step taking
``StepCost.seconds(plan)``: a fixed overhead plus a cost per prefill token pass and per decode
row — a model of an accelerator that is busy in proportion to the work a step does, so a
prefill saved by the prefix cache is time saved. Requests arrive at given times (or when an
earlier one finishes: ``follow_up``, for conversations), are placed by a ``Placement`` (the
service's ``Placer``, or another rule to compare with) and, while they wait unstarted, may be
pulled by a node that frees up, as the service does (``placement.pull``).

Times are seconds of simulated time; nothing depends on the wall clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvgate.admission_service.placement import Ask, ExecutorView, Placer, pull
from kvgate.protocol.capacity import blocks_for
from kvgate.protocol.step import LoopParams, SamplingParams, StepPlan, StepResult
from kvgate.scheduler.config import CacheConfig, ModelShape, SchedulerConfig
from kvgate.scheduler.events import FinishedEvent, StepReport, TokenEvent
from kvgate.scheduler.request import RequestProgress, RequestSpec
from kvgate.scheduler.scheduler import Scheduler
from kvgate.sim.runner import StepExecutor


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds a step takes: ``overhead_s + prefill_token_s × token passes + decode_row_s ×
    decode rows``."""

    overhead_s: float = 0.004
    prefill_token_s: float = 0.00005
    decode_row_s: float = 0.0002

    def seconds(self, report: StepReport) -> float:
        return (
            self.overhead_s
            + self.prefill_token_s * report.prefill_tokens
            + self.decode_row_s * report.decode_rows
        )


@dataclass(frozen=True, slots=True)
class ClusterRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float
    priority: int = 0
    tenant: str | None = None
    deadline_s: float | None = None
    affinity_key: str | None = None
    seed: int = 0

    def spec(self) -> RequestSpec:
        return RequestSpec(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling=SamplingParams(max_tokens=self.max_tokens, seed=self.seed, ignore_eos=True),
            loops=LoopParams(),
            priority=self.priority,
            deadline_s=self.deadline_s,
            tenant=self.tenant,
        )

    def ask(self, moves: int = 0) -> Ask:
        return Ask(
            self.request_id, self.prompt_token_ids, self.max_tokens, self.affinity_key, moves
        )


@dataclass(slots=True)
class Outcome:
    request: ClusterRequest
    executor: str
    first_token_s: float | None = None
    finished_s: float | None = None
    event: FinishedEvent | None = None
    moves: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.request.arrival_s


PlanObserver = Callable[["Node", StepPlan, StepReport], None]


class Node:
    """One executor and its scheduler, as placement sees it (an ``ExecutorView``)."""

    def __init__(
        self, name: str, scheduler: Scheduler, executor: StepExecutor, *, check: bool = False
    ) -> None:
        self.on_plan: PlanObserver | None = None  # sees each planned step before it runs
        self.check = check  # the scheduler's invariants after every schedule and apply
        self.name = name
        self.scheduler = scheduler
        self.executor = executor
        self.busy_until: float | None = None  # a step runs until then
        self._inflight: tuple[StepPlan, StepResult] | None = None
        self._reserved: dict[str, int] = {}
        self._backlog: dict[str, int] = {}
        self.prefill_tokens = 0
        self.decode_rows = 0
        self.steps = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # --- ExecutorView ----------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.scheduler.state.cache.block_size

    @property
    def outstanding(self) -> int:
        return len(self._reserved)

    @property
    def backlog_tokens(self) -> int:
        return sum(self._backlog.values())

    @property
    def headroom_blocks(self) -> int:
        return self.scheduler.state.cache.num_blocks - sum(self._reserved.values())

    def cached_prefix_pages(self, digests: Sequence[bytes]) -> int:
        return self.scheduler.cached_prefix_pages(digests)

    def has_room_for(self, prompt_len: int, max_tokens: int) -> bool:
        return self.headroom_blocks >= self._need(prompt_len, max_tokens)

    # --- requests ------------------------------------------------------------------------------
    def _need(self, prompt_len: int, max_tokens: int) -> int:
        state = self.scheduler.state
        return blocks_for(
            prompt_len, max_tokens, block_size=state.cache.block_size, num_planes=state.num_planes
        )

    def place(
        self, request: ClusterRequest, now: float, progress: RequestProgress | None = None
    ) -> None:
        self.scheduler.add_request(request.spec(), progress=progress, now=now)
        rid = request.request_id
        self._reserved[rid] = self._need(len(request.prompt_token_ids), request.max_tokens)
        self._backlog[rid] = len(request.prompt_token_ids)

    def withdraw(self, request_id: str) -> RequestProgress | None:
        progress = self.scheduler.withdraw(request_id)
        if progress is not None:
            self._reserved.pop(request_id, None)
            self._backlog.pop(request_id, None)
        return progress

    def waiting_unstarted(self) -> list[str]:
        return list(self._backlog)

    def own_backlog(self, request_id: str) -> int:
        return self._backlog.get(request_id, 0)

    # --- steps ---------------------------------------------------------------------------------
    def start_step(self, now: float, cost: StepCost) -> bool:
        """Plan and run a step from ``now`` (its result is applied at ``busy_until``)."""
        if self.busy_until is not None or not self.scheduler.has_work:
            return False
        plan = self.scheduler.schedule(now)
        if self.check:
            self.scheduler.check_invariants()
        report = self.scheduler.last_report
        for rid, _ in report.admitted:
            self._backlog.pop(rid, None)
        if plan is None:
            return False
        self.steps += 1
        self.prefill_tokens += report.prefill_tokens
        self.decode_rows += report.decode_rows
        self.prefix_queried_tokens += report.prefix_queried_tokens
        self.prefix_hit_tokens += report.prefix_hit_tokens
        if self.on_plan is not None:
            self.on_plan(self, plan, report)
        self._inflight = (plan, self.executor.execute(plan))
        self.busy_until = now + cost.seconds(report)
        return True

    def finish_step(self) -> list[FinishedEvent | TokenEvent]:
        assert self._inflight is not None
        _, result = self._inflight
        self._inflight = None
        self.busy_until = None
        events = self.scheduler.apply(result)
        if self.check:
            self.scheduler.check_invariants()
        out: list[FinishedEvent | TokenEvent] = []
        for event in [*events, *self.scheduler.pop_events()]:
            if isinstance(event, FinishedEvent):
                self._reserved.pop(event.request_id, None)
                self._backlog.pop(event.request_id, None)
                out.append(event)
            elif isinstance(event, TokenEvent):
                out.append(event)
        return out


class Placement(Protocol):
    """A placement rule: executors best first for a request. Only the service's ``Placer``
    also pulls waiting requests into an executor that frees up."""

    def rank(self, ask: Ask, executors: Sequence[Node]) -> Sequence[ExecutorView]: ...


FollowUp = Callable[[ClusterRequest, FinishedEvent, float], Iterable[ClusterRequest]]


@dataclass(slots=True)
class ClusterResult:
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    end_s: float = 0.0
    moves: int = 0


class Cluster:
    def __init__(
        self,
        nodes: list[Node],
        placement: Placement,
        *,
        cost: StepCost | None = None,
        pulls: bool = True,
        on_step: Callable[[float, list[Node]], None] | None = None,
    ) -> None:
        self.nodes = nodes
        self.placement = placement
        self.cost = cost or StepCost()
        self._pulls = pulls and isinstance(placement, Placer)
        self._on_step = on_step
        self._arrivals: list[tuple[float, int, ClusterRequest]] = []
        self._seq = 0
        self.result = ClusterResult(nodes=nodes)
        self._by_name = {node.name: node for node in nodes}

    def submit(self, request: ClusterRequest) -> None:
        heapq.heappush(self._arrivals, (request.arrival_s, self._seq, request))
        self._seq += 1

    def run(self, follow_up: FollowUp | None = None, max_time_s: float = 1e9) -> ClusterResult:
        now = 0.0
        while True:
            for node in self.nodes:
                node.start_step(now, self.cost)
            busy = [node.busy_until for node in self.nodes if node.busy_until is not None]
            next_done = min(busy, default=None)
            next_arrival = self._arrivals[0][0] if self._arrivals else None
            if next_done is None and next_arrival is None:
                if any(node.scheduler.has_work for node in self.nodes):
                    now += self.cost.overhead_s  # nothing plannable now: let waits run out
                    continue
                break
            if next_done is not None and (next_arrival is None or next_done <= next_arrival):
                now = next_done
                for node in self.nodes:
                    if node.busy_until == now:
                        self._complete(node, now, follow_up)
            else:
                assert next_arrival is not None
                now = max(now, next_arrival)
                while self._arrivals and self._arrivals[0][0] <= now:
                    self._place(heapq.heappop(self._arrivals)[2], now)
            if self._on_step is not None:
                self._on_step(now, self.nodes)
            if now > max_time_s:
                break
        self.result.end_s = now
        return self.result

    def _place(self, request: ClusterRequest, now: float) -> None:
        ranked = self.placement.rank(request.ask(), self.nodes)
        node = self._by_name[ranked[0].name]
        node.place(request, now)
        if isinstance(self.placement, Placer):
            self.placement.placed(request.ask(), node)
        self.result.outcomes[request.request_id] = Outcome(request, node.name)

    def _complete(self, node: Node, now: float, follow_up: FollowUp | None) -> None:
        outcomes = self.result.outcomes
        for event in node.finish_step():
            outcome = outcomes[event.request_id]
            if isinstance(event, TokenEvent):
                if outcome.first_token_s is None:
                    outcome.first_token_s = now
                continue
            outcome.finished_s = now
            outcome.event = event
            if isinstance(self.placement, Placer):
                self.placement.left(event.request_id, outcome.request.affinity_key)
            if follow_up is not None:
                for nxt in follow_up(outcome.request, event, now):
                    self.submit(nxt)
        if self._pulls and node.scheduler.num_waiting == 0:
            self._pull_into(node, now)

    def _pull_into(self, target: Node, now: float) -> None:
        assert isinstance(self.placement, Placer)
        outcomes = self.result.outcomes
        queued = [
            (source, outcomes[rid].request.ask(outcomes[rid].moves), source.own_backlog(rid))
            for source in self.nodes
            if source is not target
            for rid in source.waiting_unstarted()
        ]
        queued.sort(key=lambda item: outcomes[item[1].request_id].request.arrival_s)
        config = target.scheduler.config
        budget = config.max_num_seqs - target.scheduler.num_running

        placer = self.placement

        def move(ask: Ask, source: ExecutorView, into: ExecutorView) -> bool:
            assert isinstance(source, Node) and isinstance(into, Node)
            progress = source.withdraw(ask.request_id)
            if progress is None:
                return False
            outcome = outcomes[ask.request_id]
            into.place(outcome.request, now, progress)
            placer.left(ask.request_id, ask.affinity_key)
            placer.placed(ask, into)
            outcome.executor = into.name
            outcome.moves += 1
            self.result.moves += 1
            return True

        pull(placer, target, queued, budget, move)


def build_node(
    name: str,
    config: SchedulerConfig,
    executor: StepExecutor,
    *,
    enable_prefix_caching: bool = True,
    check: bool = False,
) -> Node:
    info = executor.info
    cache = CacheConfig(
        num_blocks=info.num_blocks,
        block_size=info.block_size,
        host_snapshot_blocks=info.host_snapshot_blocks,
        enable_prefix_caching=enable_prefix_caching,
    )
    model = ModelShape(
        num_loops=info.num_loops, eos_token_id=info.eos_token_id, max_model_len=info.max_model_len
    )
    return Node(name, Scheduler(config, cache, model), executor, check=check)
