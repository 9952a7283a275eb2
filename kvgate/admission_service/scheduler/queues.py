"""The waiting queue (a heap by admission key) and the running set (sorted by admission key).

The admission scan touches at most ``admission_scan_limit`` waiting entries per step, so a step's
cost does not grow with the length of the waiting queue: popping and pushing back are
``O(log n)`` each, and removed entries are dropped lazily when they surface.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Iterator

from kvgate.admission_service.scheduler.request import Request, RequestStatus


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, ...], str, Request]] = []
        self._members: set[str] = set()

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._members

    def push(self, request: Request) -> None:
        if request.request_id in self._members:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        self._members.add(request.request_id)
        heapq.heappush(self._heap, (request.key, request.request_id, request))

    def pop(self) -> Request | None:
        """Remove and return the most important waiting request."""
        while self._heap:
            _, request_id, request = heapq.heappop(self._heap)
            if request_id in self._members and request.status is RequestStatus.WAITING:
                self._members.discard(request_id)
                return request
        return None

    def discard(self, request: Request) -> None:
        """Forget a request (it surfaces later as a stale heap entry and is skipped)."""
        self._members.discard(request.request_id)

    def ordered(self, limit: int | None = None) -> list[Request]:
        """The first ``limit`` live entries in admission order (for audits and reports)."""
        live = [entry for entry in self._heap if entry[1] in self._members]
        if limit is None:
            live.sort()
        else:
            live = heapq.nsmallest(limit, live)
        return [entry[2] for entry in live]


class RunningSet:
    """Running requests in admission order; the victim order is ``reversed()``."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, ...]] = []
        self._requests: list[Request] = []

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __reversed__(self) -> Iterator[Request]:
        return reversed(self._requests)

    def count_below(self, key: tuple[int, ...]) -> int:
        """How many running requests come before ``key`` in admission order."""
        return bisect_left(self._keys, key)

    def last(self) -> Request:
        """The least important running request (the first in victim order)."""
        return self._requests[-1]

    def snapshot(self) -> list[Request]:
        return list(self._requests)

    def between(self, after: tuple[int, ...] | None, before: tuple[int, ...]) -> Iterator[Request]:
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
