"""The scheduler's state, its two queues and the small accounting helpers every phase shares.

The waiting queue is a heap by admission key; the running set is sorted by admission key (its
reverse is the victim order). The admission scan touches at most ``admission_scan_limit``
waiting entries per step, so a step's cost does not grow with the length of the waiting queue:
popping and pushing back are ``O(log n)`` each, and removed entries are dropped lazily when they
surface.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import count

from kvgate.protocol.step import SnapshotAdopt, SnapshotExport, StepPlan
from kvgate.scheduler.config import (
    AdmissionPricing,
    CacheConfig,
    ModelShape,
    PreemptionMode,
    SchedulerConfig,
)
from kvgate.scheduler.kv import BlockPool
from kvgate.scheduler.request import AdmissionKey, Request, RequestStatus


class WaitingQueue:
    """Waiting requests by their fixed admission keys. Under fairness the scheduler uses
    ``fairness.FairWaitingQueue`` instead, whose keys follow the tenants' shares; the hooks at
    the end are where it keeps them (nothing to keep here).

    Heap entries are ``(key, request id, push number, request)``. A removed request's entry
    stays until it surfaces, and the same id may be pushed again meanwhile (a request withdrawn
    for placement and put back) under the same key: the push number keeps the heap from ever
    comparing two requests, and an entry is live only while its request object is the member
    under that id."""

    def __init__(self) -> None:
        self._heap: list[tuple[AdmissionKey, str, int, Request]] = []
        self._members: dict[str, Request] = {}
        self._pushes = count()

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, request: Request) -> bool:
        return self._members.get(request.request_id) is request

    def push(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._members:
            raise ValueError(f"request {rid!r} is already waiting")
        self._members[rid] = request
        heapq.heappush(self._heap, (request.key, rid, next(self._pushes), request))

    def pop(self) -> Request | None:
        """Remove and return the most important waiting request."""
        while self._heap:
            _, request_id, _, request = heapq.heappop(self._heap)
            if self._members.get(request_id) is request and request.status is RequestStatus.WAITING:
                del self._members[request_id]
                return request
        return None

    def discard(self, request: Request) -> None:
        """Forget a request (it surfaces later as a stale heap entry and is skipped)."""
        if self._members.get(request.request_id) is request:
            del self._members[request.request_id]

    def ordered(self, limit: int | None = None) -> list[Request]:
        """The first ``limit`` live entries in admission order (for audits and reports)."""
        live = [entry for entry in self._heap if self._members.get(entry[1]) is entry[3]]
        if limit is None:
            live.sort()
        else:
            live = heapq.nsmallest(limit, live)
        return [entry[3] for entry in live]

    # --- fair sharing hooks ----------------------------------------------------------------
    def started(self, request: Request) -> None:
        """``request`` was just admitted (before its first admission is recorded)."""

    def refresh(self, served: Iterable[Request]) -> None:
        """A result was applied: the ``served`` requests (still here) got output tokens."""

    def settle(self, request: Request) -> None:
        """``request`` finished: its last tokens are served."""


class RunningSet:
    """Running requests in admission order; the victim order is ``reversed()``."""

    def __init__(self) -> None:
        self._keys: list[AdmissionKey] = []
        self._requests: list[Request] = []

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __reversed__(self) -> Iterator[Request]:
        return reversed(self._requests)

    def count_below(self, key: AdmissionKey) -> int:
        """How many running requests come before ``key`` in admission order."""
        return bisect_left(self._keys, key)

    def last(self) -> Request:
        """The least important running request (the first in victim order)."""
        return self._requests[-1]

    def snapshot(self) -> list[Request]:
        return list(self._requests)

    def between(self, after: AdmissionKey | None, before: AdmissionKey) -> Iterator[Request]:
        """Running requests with ``after < key < before`` in order (``after`` None: from the
        first). The set must not change while this is iterated."""
        start = 0 if after is None else bisect_right(self._keys, after)
        requests = self._requests
        for index in range(start, bisect_left(self._keys, before)):
            yield requests[index]

    def add(self, request: Request) -> None:
        index = bisect_left(self._keys, request.key)
        self._keys.insert(index, request.key)
        self._requests.insert(index, request)

    def remove(self, request: Request) -> None:
        index = bisect_left(self._keys, request.key)
        if index >= len(self._requests) or self._requests[index] is not request:
            raise ValueError(f"request {request.request_id!r} is not running")
        del self._keys[index]
        del self._requests[index]


@dataclass(slots=True)
class SchedulerState:
    config: SchedulerConfig
    cache: CacheConfig
    model: ModelShape
    pool: BlockPool
    requests: dict[str, Request] = field(default_factory=dict)
    waiting: WaitingQueue = field(default_factory=WaitingQueue)
    running: RunningSet = field(default_factory=RunningSet)
    step: int = 0
    now: float = 0.0  # the time the last step was planned at (arrivals are stamped with it)
    host_blocks_used: int = 0
    next_arrival_seq: int = 0
    owed_blocks: int = 0  # sum over running requests of owed_pages × planes
    pending_free: list[str] = field(default_factory=list)
    # Migration: snapshots to hand out (a drain) and staged imports to take in, next plan.
    pending_exports: list[SnapshotExport] = field(default_factory=list)
    pending_adopts: list[SnapshotAdopt] = field(default_factory=list)
    deadlines: list[tuple[float, int, str]] = field(default_factory=list)  # heap
    inflight: dict[int, StepPlan] = field(default_factory=dict)
    prefill_steps_since_decode: int = 0
    steps_without_progress: int = 0

    # --- accounting helpers ------------------------------------------------------------------
    @property
    def num_planes(self) -> int:
        return self.model.num_loops

    @property
    def watermark_blocks(self) -> int:
        return int(self.config.watermark_ratio * self.cache.num_blocks)

    @property
    def preemption_enabled(self) -> bool:
        return self.config.preemption is not PreemptionMode.OFF

    def capacity_pages(self, request: Request) -> int:
        return self.pool.pages_for(request.capacity_tokens)

    def prefill_cost_per_token(self) -> int:
        """Loop passes one prefill token costs in a row (the step budget counts token passes)."""
        return 1 if self.config.wavefront_prefill else self.num_planes

    def first_chunk_tokens(self, fill_tokens: int) -> int:
        budget_tokens = self.config.max_num_batched_tokens // self.prefill_cost_per_token()
        return max(1, min(fill_tokens, self.config.prefill_chunk_size, budget_tokens))

    def owed_target_pages(self, request: Request) -> int:
        """Pages a running request was promised at admission: its whole fill while it fills
        under ``fill`` pricing (so admitting others never strands a prompt half-way), its whole
        capacity when preemption is off (nothing could make room later), nothing otherwise
        (growth is recovered by preemption)."""
        if not self.preemption_enabled:
            return self.capacity_pages(request)
        if request.fill is not None and self.config.admission_pricing is AdmissionPricing.FILL:
            return self.pool.pages_for(request.fill.length)
        return 0

    def refresh_owed(self, request: Request) -> None:
        owed = 0
        if request.status is RequestStatus.RUNNING:
            held = self.pool.num_pages(request.request_id)
            owed = max(0, self.owed_target_pages(request) - held)
        self.owed_blocks += (owed - request.owed_pages) * self.num_planes
        request.owed_pages = owed

    def grow(self, request: Request, num_pages: int) -> list[tuple[int, ...]] | None:
        pages = self.pool.grow(request.request_id, num_pages)
        if pages:
            self.refresh_owed(request)
        return pages

    def release_blocks(self, request: Request) -> int:
        """Release a running request's table; returns how many pages it held."""
        self.owed_blocks -= request.owed_pages * self.num_planes
        request.owed_pages = 0
        return len(self.pool.release(request.request_id))

    def mark_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.add(request)
        self.refresh_owed(request)

    def unresolved(self, request: Request) -> bool:
        """Its last rows are still in flight (async scheduling): their outcome is unknown."""
        return request.inflight_step is not None and request.inflight_step < self.step
