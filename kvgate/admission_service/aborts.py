"""Aborts that arrived before their request: remembered for a while, bounded in number.

An abort record may overtake its request (they travel on different topics). The service
remembers the id for ``ttl_s``; a request read with that id within the window is answered
``aborted`` at once instead of running.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Final

MAX_REMEMBERED: Final = 100_000


class AbortMemory:
    def __init__(
        self, ttl_s: float, clock: Callable[[], float], *, max_entries: int = MAX_REMEMBERED
    ) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._max_entries = max_entries
        self._expiry: OrderedDict[str, float] = OrderedDict()  # id -> forget after (clock)

    def __len__(self) -> int:
        return len(self._expiry)

    def remember(self, request_id: str) -> None:
        now = self._clock()
        self._expiry[request_id] = now + self._ttl_s
        self._expiry.move_to_end(request_id)
        while self._expiry:
            oldest, expires = next(iter(self._expiry.items()))
            if expires > now and len(self._expiry) <= self._max_entries:
                break
            del self._expiry[oldest]

    def take(self, request_id: str) -> bool:
        """Whether an unexpired abort waits for ``request_id`` (forgotten either way)."""
        expires = self._expiry.pop(request_id, None)
        return expires is not None and expires > self._clock()
