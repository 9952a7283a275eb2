"""One answer per request id: the ids answered within ``limits.idempotency_window_s``.

A request whose id is in flight here or was answered within the window is a duplicate: it is
dead-lettered (code ``duplicate``) and gets no result, so a consumer of the results topic sees
exactly one answer per id — whichever copy was read first. So does a bad record keyed with
such an id: it is dead-lettered without a second (``rejected``) result.

Where the ids come from::

    answers made here             added when the answer is made; forgotten again if the answer
                                  is discarded before it is durable (its partition revoked or
                                  fenced), since the request then runs again (a crash forgets
                                  everything anyway)
    answers made before           read back from the results partition when a request partition
    (a previous owner, a restart) is assigned (``kafka_io.scan_answered``): every result written
                                  within the window, from the offset for ``now - window``

Ids are remembered per service instance; requests keyed by their id (the protocol's rule) land
in one partition, so every copy of an id meets the same owner. Kept at most ``max_ids``: the
oldest are forgotten first when a flood of ids arrives faster than the window expires them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable


class AnsweredIds:
    def __init__(
        self,
        window_s: float,
        max_ids: int,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.window_s = window_s
        self.max_ids = max_ids
        self._clock = clock  # wall-clock: results carry wall-clock timestamps
        self._answered_at: OrderedDict[str, float] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._answered_at)

    def __contains__(self, request_id: str) -> bool:
        at = self._answered_at.get(request_id)
        return at is not None and at > self._clock() - self.window_s

    def add(self, request_id: str, at_s: float | None = None) -> None:
        """``request_id`` was answered at ``at_s`` (wall-clock seconds; now when None)."""
        at = self._clock() if at_s is None else at_s
        if at <= self._clock() - self.window_s:
            return
        previous = self._answered_at.get(request_id)
        if previous is not None and previous >= at:
            return
        self._answered_at[request_id] = at
        self._answered_at.move_to_end(request_id)
        self._expire()

    def forget(self, request_ids: Iterable[str]) -> None:
        """These answers were discarded before they were durable (their partition was revoked
        or fenced): the requests run again, and must not count as duplicates of themselves."""
        for request_id in request_ids:
            self._answered_at.pop(request_id, None)

    def add_all(self, answered: Iterable[tuple[str, float]]) -> None:
        """Answers read back from Kafka (possibly out of order): (id, wall-clock seconds)."""
        for request_id, at in sorted(answered, key=lambda item: item[1]):
            self.add(request_id, at)

    def _expire(self) -> None:
        oldest_kept = self._clock() - self.window_s
        entries = self._answered_at
        while entries:
            request_id, at = next(iter(entries.items()))
            if at > oldest_kept and len(entries) <= self.max_ids:
                break
            del entries[request_id]
