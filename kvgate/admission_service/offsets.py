"""Which consumed offsets may be committed, and which requests are already answered (pure).

Per request partition, a :class:`PartitionLedger` tracks the offsets read but not yet *final*
(their result, dead letter or hand-off is not durable yet)::

    offsets   ... c ............ f1 .. f2 ....... r) next read
                  ^ committed      final above the commit point (out-of-order completion)
    commit point = the lowest offset still in flight, else the next offset to read

Committing the commit point never skips unanswered work: everything below it is final. Work
above it that finished early is answered but would be read again by the partition's next owner;
to skip it, each commit records in its metadata a position in the co-partitioned results
partition from which every such answer can be found (:func:`encode_metadata`). On assignment
the new owner reads the results partition from there (``skip_scan``) and feeds the answered
source offsets to :meth:`PartitionLedger.skip`; reading such an offset again finalises it at once
without running the request.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

METADATA_PREFIX: Final = "kvgate/1 results_from="


def encode_metadata(results_offset: int | None) -> str:
    return "" if results_offset is None else f"{METADATA_PREFIX}{results_offset}"


def decode_metadata(metadata: str | None) -> int | None:
    """The results offset a commit recorded, or None (unknown: read the partition from its
    start). Foreign or damaged metadata counts as unknown, never as an error."""
    if not metadata or not metadata.startswith(METADATA_PREFIX):
        return None
    text = metadata[len(METADATA_PREFIX) :]
    return int(text) if text.isdigit() else None


@dataclass(frozen=True, slots=True)
class CommitPoint:
    offset: int  # the next offset the group will read from
    metadata: str


@dataclass(slots=True)
class PartitionLedger:
    """Offsets of one request partition from assignment to revocation.

    ``committed``: the group's committed offset at assignment (None: none yet).
    ``answered``: source offset -> results offset of answers found above ``committed``.
    ``results_end``: where the results partition ended when it was read at assignment.
    """

    committed: int | None = None
    answered: dict[int, int] = field(default_factory=dict)
    results_end: int | None = None
    _inflight: list[int] = field(default_factory=list)  # heap, lazily pruned
    _open: set[int] = field(default_factory=set)
    _final_above: dict[int, int | None] = field(default_factory=dict)  # offset -> results offset
    _next_read: int | None = None
    _last_committed: CommitPoint | None = None
    _results_high: int | None = None  # results partition end as far as known

    def __post_init__(self) -> None:
        self._results_high = self.results_end

    def read(self, offset: int) -> int | None:
        """Record that ``offset`` was read; returns its results offset if already answered
        (then it is final at once and must not run again), else None (now in flight)."""
        self._next_read = max(self._next_read or 0, offset + 1)
        answered = self.answered.pop(offset, None)
        if answered is not None:
            self._final_above[offset] = answered
            return answered
        if offset not in self._open:
            self._open.add(offset)
            heapq.heappush(self._inflight, offset)
        return None

    def in_flight(self, offset: int) -> bool:
        return offset in self._open

    def commit_point(self, finals: Mapping[int, int | None] = {}) -> CommitPoint | None:
        """Where to commit once ``finals`` (offset -> its results offset, if it wrote one)
        are durable too; None when nothing new could be committed."""
        if self._next_read is None:
            return None
        self._prune()
        if not finals:
            lowest = self._inflight[0] if self._inflight else None
        else:
            lowest = min((o for o in self._open if o not in finals), default=None)
        point = self._next_read if lowest is None else lowest
        commit = CommitPoint(point, encode_metadata(self._results_from(point, finals)))
        return None if commit == self._last_committed else commit

    def _results_from(self, point: int, finals: Mapping[int, int | None]) -> int | None:
        """Lowest results offset of an answer to a request at or above ``point``; if there is
        none, the results partition's end as far as known (answers come after it)."""
        candidates = [r for o, r in self._final_above.items() if o >= point and r is not None]
        candidates += [r for o, r in finals.items() if o >= point and r is not None]
        candidates += [r for o, r in self.answered.items() if o >= point]
        if candidates:
            return min(candidates)
        known_end = [r + 1 for r in finals.values() if r is not None]
        if self._results_high is not None:
            known_end.append(self._results_high)
        return max(known_end) if known_end else None

    def finalize(self, finals: Mapping[int, int | None]) -> None:
        """``finals`` are durable (results written, or handed off as done)."""
        for offset, results_offset in finals.items():
            self._open.discard(offset)
            self._final_above[offset] = results_offset
            if results_offset is not None:
                self._results_high = max(self._results_high or 0, results_offset + 1)
        self._prune()

    def committed_at(self, point: CommitPoint) -> None:
        """``point`` is committed: answers below it will never be read again."""
        self._last_committed = point
        self.committed = point.offset
        for offset in [o for o in self._final_above if o < point.offset]:
            del self._final_above[offset]
        for offset in [o for o in self.answered if o < point.offset]:
            del self.answered[offset]

    def _prune(self) -> None:
        heap = self._inflight
        while heap and heap[0] not in self._open:
            heapq.heappop(heap)
