"""Fair sharing between tenants within a priority class: virtual token counters, and the waiting
queue that orders by them (``fairness: tokens``).

The counters follow VTC ("Fairness in Serving Large Language Models", OSDI 2024), weighted::

    counter[k, t] += n / weight(t)   for the n prompt tokens of a request's first admission here
                                     and for every output token it is served
    t becomes backlogged in class k  (its first waiting request r arrives):
        floor[k]      ← max(floor[k], min counter of the tenants already backlogged in k)
        counter[k, t] ← max(counter[k, t], floor[k] − credit)
    credit = max(cost(r), fair_burst_tokens) / weight(t),  cost(r) = prompt tokens + max_tokens

The lift keeps a tenant that was idle from returning with credit for all the time it sent
nothing: at most a burst's worth (VTC lifts to the floor itself). That burst lets a tenant under
its share be served at once: its requests go ahead of the backlogged tenants' and, on an
executor whose slots they fill, may displace theirs (``standing`` and ``reach``;
``policy.may_evict``) — a light tenant's time to first token stays near its time alone while
another floods (benchmarks/bench_fairness.py). ``floor`` never decreases.

The order is ``policy.admission_key`` with the tenant's counter as the *share*:
``(priority, share, [deadline], arrival)``. Shares change while requests wait, so the key of a
request that has never been admitted is not fixed at arrival. Instead:

- Requests not yet admitted here wait in a *lane* per (class, tenant), ordered by their key
  without the share (deadline, arrival): within a lane every request has the same share, so
  that is the waiting order among them.
- Only each lane's first request (its *head*) is in the waiting heap, stamped with its tenant's
  share at the moment: when it becomes the head, and again whenever the share changes (an
  admission charges the prompt at once; output tokens are charged when a result is applied).
  A re-stamp pushes a new heap entry; the old one is dropped when it surfaces (tickets).
- From its first admission on a request's key is fixed: the running set and the victim order
  need fixed keys, and a preempted request goes back into the heap with the key it ran with.

So the heap is always the fair order of the moment, and an admission scan pops in increasing key
order: a head exposed by an admission carries its tenant's new, larger share. Invariant 7
(``invariants.py``) checks the stamps, the lanes and the charges after every step; the bound on
waiting is in docs/scheduler.md ("Tenants and deadlines").

Fairness is per scheduler, that is per executor: contention for an executor's slots and blocks is
shared there. Counters of tenants are kept for as long as the scheduler lives (a tenant seen
once costs one entry per class).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from itertools import count

from kvgate.scheduler.policy import Lane, Ordering
from kvgate.scheduler.request import AdmissionKey, Request, RequestStatus
from kvgate.scheduler.state import WaitingQueue


class TenantClock:
    """Virtual token counters per (class, tenant), weighted, with the per-class floor."""

    __slots__ = ("_burst_tokens", "_counters", "_credits", "_default_weight", "_floors", "_weights")

    def __init__(
        self, weights: Mapping[str, float], default_weight: float, burst_tokens: int = 0
    ) -> None:
        self._weights = dict(weights)
        self._default_weight = default_weight
        self._burst_tokens = burst_tokens
        self._counters: dict[Lane, float] = {}
        self._floors: dict[int, float] = {}
        self._credits: dict[Lane, float] = {}  # below the floor at the lane's last lift

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, self._default_weight)

    def share(self, lane: Lane) -> float:
        return self._counters.get(lane, 0.0)

    def floor(self, priority_class: int) -> float:
        return self._floors.get(priority_class, 0.0)

    def charge(self, lane: Lane, num_tokens: int) -> None:
        self._counters[lane] = self.share(lane) + num_tokens / self.weight(lane[1])

    def credit(self, lane: Lane) -> float:
        """How far below the floor ``lane``'s last lift let it start."""
        return self._credits.get(lane, 0.0)

    def lift(self, lane: Lane, backlogged: Iterable[Lane], num_tokens: int) -> None:
        """``lane``'s tenant becomes backlogged, with a request of ``num_tokens`` (prompt and
        max_tokens), while the ``backlogged`` lanes of its class are."""
        priority_class = lane[0]
        floor = self.floor(priority_class)
        least = min((self.share(other) for other in backlogged), default=floor)
        floor = max(floor, least)
        self._floors[priority_class] = floor
        credit = max(num_tokens, self._burst_tokens) / self.weight(lane[1])
        self._credits[lane] = credit
        self._counters[lane] = max(self.share(lane), floor - credit)

    def counters(self) -> dict[Lane, float]:
        return dict(self._counters)


def _cost(request: Request) -> int:
    """What a request may cost its tenant: its prompt tokens and max_tokens."""
    return request.prompt_len + request.spec.sampling.max_tokens


# Tickets come from one counter per queue, so no two entries share one: the heaps never compare
# two requests, even when a request withdrawn for placement comes back under the same id and key
# while its old entries are still there. An entry is live while its ticket is its request's and
# that request object is the one waiting under its id.
_Entry = tuple[AdmissionKey, str, int, Request]  # (key, request id, ticket, request)
_LaneEntry = tuple[AdmissionKey, str, int, Request]  # (key without the share, id, ticket, request)


class FairWaitingQueue(WaitingQueue):
    """The waiting queue under fairness: lanes of requests not yet admitted, one head per lane in
    the heap stamped with its tenant's current share, and keyed requests (preempted) as they are.
    See the module docstring."""

    def __init__(self, ordering: Ordering, clock: TenantClock) -> None:
        super().__init__()
        self.ordering = ordering
        self.clock = clock
        self._entries: list[_Entry] = []
        self._tickets = count(1)
        self._live: dict[str, Request] = {}
        self._lanes: dict[Lane, list[_LaneEntry]] = {}
        self._lane_sizes: dict[Lane, int] = {}  # live members of each non-empty lane
        self._heads: dict[Lane, Request] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request: Request) -> bool:
        return self._live.get(request.request_id) is request

    # --- the queue -----------------------------------------------------------------------------
    def push(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._live:
            raise ValueError(f"request {rid!r} is already waiting")
        self._live[rid] = request
        if request.keyed:
            self._enter(request)
            return
        ordering = self.ordering
        lane = ordering.lane(request)
        if lane not in self._lane_sizes:
            backlogged = [other for other in self._lane_sizes if other[0] == lane[0]]
            self.clock.lift(lane, backlogged, _cost(request))
            self._lane_sizes[lane] = 0
        self._lane_sizes[lane] += 1
        lane_entry = (ordering.key(request), rid, next(self._tickets), request)
        heapq.heappush(self._lanes.setdefault(lane, []), lane_entry)
        head = self._heads.get(lane)
        if head is None or ordering.key(request) < ordering.key(head):
            if head is not None:
                head.queue_ticket = next(self._tickets)  # its heap entry is stale now
                head.key = ordering.key(head, self.clock.share(lane))
            self._heads[lane] = request
            self._stamp(request, lane)
        else:
            request.key = ordering.key(request, self.clock.share(lane))

    def pop(self) -> Request | None:
        """Remove and return the most important waiting request (the smallest current key)."""
        while self._entries:
            _, rid, ticket, request = heapq.heappop(self._entries)
            if ticket != request.queue_ticket or self._live.get(rid) is not request:
                continue
            if request.status is not RequestStatus.WAITING:
                continue
            request.queue_ticket = next(self._tickets)
            if not request.keyed:
                lane = self.ordering.lane(request)
                top = self._lane_top(lane)
                assert top is request, "a lane's head is its first request"
                heapq.heappop(self._lanes[lane])
                del self._live[rid]
                self._left_lane(lane, request)
            else:
                del self._live[rid]
            return request
        return None

    def discard(self, request: Request) -> None:
        rid = request.request_id
        if self._live.get(rid) is not request:
            return
        del self._live[rid]
        request.queue_ticket = next(self._tickets)
        if not request.keyed:
            self._left_lane(self.ordering.lane(request), request)

    def ordered(self, limit: int | None = None) -> list[Request]:
        """Every waiting request in the order of the moment (lane members keyed with their
        tenant's share now), the first ``limit``."""
        clock, ordering = self.clock, self.ordering
        for request in self._live.values():
            if not request.keyed:
                request.key = ordering.key(request, clock.share(ordering.lane(request)))
        found = sorted(self._live.values(), key=lambda r: (r.key, r.request_id))
        return found if limit is None else found[:limit]

    # --- charges -------------------------------------------------------------------------------
    def started(self, request: Request) -> None:
        if request.keyed:
            return  # a restore: its prompt was charged at its first admission here
        lane = self.ordering.lane(request)
        self.clock.charge(lane, request.prompt_len)
        request.charged_outputs = len(request.output_token_ids)
        self._restamp(lane)

    def refresh(self, served: Iterable[Request]) -> None:
        changed: set[Lane] = set()
        for request in served:
            if self._charge_outputs(request):
                changed.add(self.ordering.lane(request))
        for lane in changed:
            self._restamp(lane)
        if len(self._entries) > 2 * len(self._live) + 64:
            self._compact()

    def settle(self, request: Request) -> None:
        if request.keyed and self._charge_outputs(request):
            self._restamp(self.ordering.lane(request))

    def standing(self, running: Request) -> AdmissionKey:
        """The key ``running`` would have were it waiting now (its tenant's share now)."""
        return self.ordering.key(running, self.clock.share(self.ordering.lane(running)))

    def reach(self, waiting: Request) -> AdmissionKey:
        """The key ``waiting`` would have once served in full (its tenant's share plus its
        cost): admission under fairness displaces running work of another tenant only when
        this is below that work's ``standing`` (``policy.may_evict``), so a preemption never
        takes its requester's tenant past the victim's, and two tenants near equal shares do
        not trade victims back and forth."""
        lane = self.ordering.lane(waiting)
        share = self.clock.share(lane) + _cost(waiting) / self.clock.weight(waiting.tenant)
        return self.ordering.key(waiting, share)

    # --- views for the invariant checks ----------------------------------------------------
    def lanes(self) -> dict[Lane, list[Request]]:
        """Live members of every non-empty lane, in lane order."""
        out: dict[Lane, list[Request]] = {}
        for lane, entries in self._lanes.items():
            members = sorted(e for e in entries if self._live.get(e[1]) is e[3])
            if members:
                out[lane] = [entry[3] for entry in members]
        return out

    def heads(self) -> dict[Lane, Request]:
        return dict(self._heads)

    def live_entries(self) -> list[tuple[AdmissionKey, Request]]:
        """The heap's live entries: (key it was pushed with, request)."""
        return [
            (key, request)
            for key, rid, ticket, request in self._entries
            if ticket == request.queue_ticket and self._live.get(rid) is request
        ]

    # --- internals -----------------------------------------------------------------------------
    def _charge_outputs(self, request: Request) -> bool:
        served = len(request.output_token_ids) - request.charged_outputs
        if served <= 0:
            return False
        self.clock.charge(self.ordering.lane(request), served)
        request.charged_outputs += served
        return True

    def _enter(self, request: Request) -> None:
        request.queue_ticket = next(self._tickets)
        heapq.heappush(
            self._entries, (request.key, request.request_id, request.queue_ticket, request)
        )

    def _stamp(self, request: Request, lane: Lane) -> None:
        request.key = self.ordering.key(request, self.clock.share(lane))
        self._enter(request)

    def _restamp(self, lane: Lane) -> None:
        head = self._heads.get(lane)
        if head is not None and head.key != self.ordering.key(head, self.clock.share(lane)):
            self._stamp(head, lane)

    def _lane_top(self, lane: Lane) -> Request | None:
        entries = self._lanes.get(lane, [])
        while entries and self._live.get(entries[0][1]) is not entries[0][3]:
            heapq.heappop(entries)
        return entries[0][3] if entries else None

    def _left_lane(self, lane: Lane, request: Request) -> None:
        """``request`` (no longer live) left ``lane``: the lane's next request becomes its head."""
        self._lane_sizes[lane] -= 1
        if self._lane_sizes[lane] == 0:
            del self._lane_sizes[lane]
            self._lanes.pop(lane, None)
            self._heads.pop(lane, None)
            return
        if self._heads.get(lane) is not request:
            return
        head = self._lane_top(lane)
        assert head is not None, "a non-empty lane has a first request"
        self._heads[lane] = head
        self._stamp(head, lane)

    def _compact(self) -> None:
        """Drop stale heap entries (re-stamps leave one behind each)."""
        self._entries = [
            entry
            for entry in self._entries
            if entry[2] == entry[3].queue_ticket and self._live.get(entry[1]) is entry[3]
        ]
        heapq.heapify(self._entries)
