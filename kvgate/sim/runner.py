"""Run a workload: scheduler + executor, step by step, with invariant checks and a reference run.

The reference is the same workload on an unconstrained cache with preemption off; every request's
outputs (token ids and exit depths) must equal it. Bounded bypass is also audited independently
of the scheduler's own counters: before each step the waiting order is recorded, and every
admission of a request behind a still-waiting one counts as one bypass of it.

A run is judged by the invariants its strategy promises (``strategy.promises``): another rule
replayed for comparison keeps its own fairness and eviction rules, so kvgate's other invariants
are collected apart (``kvgate_violations``) and do not fail it. The audit counts overtakes in
kvgate's admission order, so it judges only a strategy that promises every kvgate invariant.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvgate.protocol.capacity import blocks_for
from kvgate.protocol.step import (
    ExecutorCounters,
    ExecutorInfo,
    LoopParams,
    SamplingParams,
    StepPlan,
    StepResult,
)
from kvgate.scheduler.config import (
    CacheConfig,
    ModelShape,
    PreemptionMode,
)
from kvgate.scheduler.errors import RequestRejected, SchedulerStalled
from kvgate.scheduler.events import AdmissionKind, FinishedEvent, StepReport
from kvgate.scheduler.invariants import ALL_INVARIANTS, Invariant
from kvgate.scheduler.request import AdmissionKey, RequestSpec
from kvgate.scheduler.scheduler import Scheduler
from kvgate.scheduler.strategy import Strategy, promises
from kvgate.sim.executor import SimExecutor
from kvgate.sim.workload import Workload


class StepExecutor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...

    @property
    def info(self) -> ExecutorInfo: ...

    @property
    def counters(self) -> ExecutorCounters: ...


ExecutorFactory = Callable[[Workload], StepExecutor]
StepObserver = Callable[[StepPlan, StepReport], None]  # each planned step, before it runs
SchedulerObserver = Callable[[float, Scheduler], None]  # after each schedule: clock, scheduler


def sim_executor(workload: Workload) -> StepExecutor:
    return SimExecutor(
        workload.model,
        num_blocks=workload.cache.num_blocks,
        block_size=workload.cache.block_size,
        host_snapshot_blocks=workload.cache.host_snapshot_blocks,
    )


@dataclass(frozen=True, slots=True)
class Arrival:
    step: int
    spec: RequestSpec


def arrivals(workload: Workload) -> list[Arrival]:
    model = workload.model
    out = []
    for request in workload.requests:
        spec = RequestSpec(
            request_id=request.id,
            prompt_token_ids=request.prompt_tokens(model),
            sampling=SamplingParams(
                max_tokens=request.max_tokens, seed=request.seed, ignore_eos=request.ignore_eos
            ),
            loops=LoopParams(min_loops=model.min_loops, exit_trace=request.exit_depths),
            priority=request.priority,
            tenant=request.tenant,
            deadline_s=None if request.deadline_step is None else float(request.deadline_step),
        )
        out.append(Arrival(request.arrival_step, spec))
    out.sort(key=lambda a: a.step)
    return out


def build_scheduler(
    workload: Workload, strategy: Strategy | None = None, *, max_model_len: int | None = None
) -> Scheduler:
    """The workload's scheduler; ``max_model_len`` is the executor's (as the service sets it)."""
    cache = CacheConfig(
        num_blocks=workload.cache.num_blocks,
        block_size=workload.cache.block_size,
        host_snapshot_blocks=workload.cache.host_snapshot_blocks,
        enable_prefix_caching=workload.cache.enable_prefix_caching,
    )
    model = ModelShape(
        num_loops=workload.model.loops,
        eos_token_id=workload.model.eos_token_id,
        max_model_len=max_model_len,
    )
    return Scheduler(workload.scheduler, cache, model, strategy)


def unconstrained(workload: Workload) -> Workload:
    """The reference variant: room for every request at once, preemption off."""
    bs = workload.cache.block_size
    model = workload.model
    blocks = 1 + sum(
        blocks_for(len(r.prompt_tokens(model)), r.max_tokens, block_size=bs, num_planes=model.loops)
        for r in workload.requests
    )
    scheduler = workload.scheduler.model_copy(
        update={
            "preemption": PreemptionMode.OFF,
            "max_num_seqs": max(1, min(len(workload.requests), 65536)),
        }
    )
    cache = workload.cache.model_copy(update={"num_blocks": max(blocks, workload.cache.num_blocks)})
    return workload.model_copy(update={"scheduler": scheduler, "cache": cache})


@dataclass(slots=True)
class RequestOutcome:
    request_id: str
    status: str  # finished | rejected | unfinished
    reason: str | None = None
    output_token_ids: tuple[int, ...] = ()
    exit_depths: tuple[int, ...] = ()
    event: FinishedEvent | None = None


@dataclass(slots=True)
class RunResult:
    outcomes: dict[str, RequestOutcome]
    steps: int = 0
    preemptions: int = 0
    restores: Counter[str] = field(default_factory=Counter)
    audited_bypasses: Counter[str] = field(default_factory=Counter)
    max_counted_bypasses: int = 0  # the largest count the strategy's own counters reached
    invariant_violations: list[str] = field(default_factory=list)  # of what the strategy promises
    kvgate_violations: list[str] = field(default_factory=list)  # kvgate's others (not judged)
    stalled: str | None = None
    leaked_blocks: int = 0
    leaked_snapshots: int = 0
    leaked_executor_requests: int = 0
    _audit_reported: set[str] = field(default_factory=set)
    _violations_seen: set[str] = field(default_factory=set)


def run_once(
    workload: Workload,
    *,
    strategy: Strategy | None = None,
    executor: StepExecutor | None = None,
    check: bool = True,
    audit: bool = True,
    observe: StepObserver | None = None,
    observe_report: SchedulerObserver | None = None,
) -> RunResult:
    """Run ``workload`` to the end. ``observe`` sees each planned step before it runs;
    ``observe_report`` sees the scheduler after each ``schedule`` (with the clock)."""
    executor = executor or sim_executor(workload)
    scheduler = build_scheduler(workload, strategy, max_model_len=executor.info.max_model_len)
    promised = promises(scheduler.strategy)
    pending = deque(arrivals(workload))
    result = RunResult(outcomes={})
    results: deque[StepResult] = deque()
    allowed = 2 if workload.scheduler.async_scheduling else 1
    try:
        for clock in range(workload.max_steps):
            while pending and pending[0].step <= clock:
                _arrive(scheduler, pending.popleft().spec, result, float(clock))
            if not (pending or results or scheduler.has_work):
                break
            plan = None
            if scheduler.num_inflight < allowed:
                before = _waiting_keys(scheduler) if audit else []
                plan = scheduler.schedule(float(clock))
                _record_step(scheduler, result, before, audit)
                if observe_report is not None:
                    observe_report(float(clock), scheduler)
                if check:
                    _check(scheduler, result, promised)
            if plan is not None:
                if observe is not None:
                    observe(plan, scheduler.last_report)
                result.steps += 1
                results.append(executor.execute(plan))
            if results and (len(results) == allowed or plan is None):
                for event in scheduler.apply(results.popleft()):
                    if isinstance(event, FinishedEvent):
                        result.outcomes[event.request_id] = RequestOutcome(
                            event.request_id,
                            "finished",
                            event.reason.value,
                            event.output_token_ids,
                            event.exit_depths,
                            event,
                        )
                if check:
                    _check(scheduler, result, promised)
    except SchedulerStalled as exc:
        result.stalled = str(exc)
    for arrival in pending:
        result.outcomes[arrival.spec.request_id] = RequestOutcome(
            arrival.spec.request_id, "unfinished", "never arrived before max_steps"
        )
    for request in scheduler.state.requests.values():
        result.outcomes.setdefault(
            request.request_id, RequestOutcome(request.request_id, "unfinished")
        )
    if not scheduler.state.requests:
        result.leaked_blocks = scheduler.state.pool.num_used_blocks
        counters = executor.counters
        result.leaked_snapshots = counters.num_snapshots + (scheduler.state.host_blocks_used > 0)
        result.leaked_executor_requests = counters.num_requests
    return result


def _arrive(scheduler: Scheduler, spec: RequestSpec, result: RunResult, now: float) -> None:
    try:
        scheduler.add_request(spec, now=now)
    except RequestRejected as exc:
        result.outcomes[spec.request_id] = RequestOutcome(spec.request_id, "rejected", exc.reason)


def _waiting_keys(scheduler: Scheduler) -> list[tuple[AdmissionKey, str]]:
    return [(r.key, r.request_id) for r in scheduler.waiting_order()]


def _record_step(
    scheduler: Scheduler,
    result: RunResult,
    waiting_before: list[tuple[AdmissionKey, str]],
    audit: bool,
) -> None:
    """Count the step's admissions and audit its overtakes: a request waiting before the step
    and still waiting after it was overtaken by every request admitted in the step with a larger
    key than its own after the step. (Keys are fixed except, under fairness, the keys of
    requests not yet admitted, which only grow with their tenant's share while a step runs:
    what passed such a request's key at the end of the step passed it all along.)"""
    report = scheduler.last_report
    result.preemptions += len(report.preemptions)
    result.max_counted_bypasses = max(result.max_counted_bypasses, report.max_bypasses)
    for _, kind in report.admitted:
        if kind != AdmissionKind.FRESH:
            result.restores[kind] += 1
    if not audit or not report.admitted:
        return
    requests = scheduler.state.requests
    admitted_keys = [requests[rid].key for rid, _ in report.admitted if rid in requests]
    admitted_ids = {rid for rid, _ in report.admitted}
    keys_after = {rid: key for key, rid in _waiting_keys(scheduler)}
    for key_before, request_id in waiting_before:
        if request_id in admitted_ids:
            continue
        key = keys_after.get(request_id, key_before)
        overtakes = sum(1 for k in admitted_keys if k > key)
        if overtakes:
            result.audited_bypasses[request_id] += overtakes


def _check(scheduler: Scheduler, result: RunResult, promised: frozenset[Invariant]) -> None:
    seen = result._violations_seen
    for invariant, problems in scheduler.invariant_violations().items():
        into = result.invariant_violations if invariant in promised else result.kvgate_violations
        for problem in problems:
            if problem not in seen:
                seen.add(problem)
                into.append(problem)
    limit = scheduler.config.max_admission_bypasses
    audit_into = (
        result.invariant_violations if promised >= ALL_INVARIANTS else result.kvgate_violations
    )
    for request_id, count in result.audited_bypasses.items():
        if count > limit and request_id not in result._audit_reported:
            result._audit_reported.add(request_id)
            audit_into.append(f"audit: {request_id} was overtaken {count} times (limit {limit})")
