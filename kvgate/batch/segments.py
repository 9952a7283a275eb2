r"""Outcomes in input order, written to the store in segments, and the finished files.

Answers come in any order; the output and error files are in input order. :class:`Pending`
holds the outcomes of lines at or above the first line not yet written and hands out the
contiguous run that starts there (``take``). A run is written as one segment, two objects
(``.out`` and ``.err``, either possibly empty) named by its line range, and only then recorded
in the checkpoint: a crash between the two leaves an object no checkpoint names, which
finalizing deletes with the rest of the batch's segments.

```
lines     next                                   holes: sent, not answered
          v
resolved  [o][o][o][o][ ][o][ ][ ][o] ...
          \__________/
           take(): up to segment_lines of them
```

Finalizing streams the segments, in order, into one object per file: the whole file never
passes through memory, only one chunk of one segment at a time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvgate.batch.lines import Outcome
from kvgate.batch.store import ObjectStore, segment_key, segment_prefix

OUT = "out"
ERR = "err"


class Pending:
    """The outcomes of lines ``next_line`` and above that are not written yet."""

    def __init__(self, next_line: int, *, segment_lines: int) -> None:
        self.next_line = next_line
        self._segment_lines = segment_lines
        self._resolved: dict[int, Outcome] = {}
        self._run_end = next_line  # the contiguous run is [next_line, _run_end)
        self._run_bytes = 0
        self._run_since_s: float | None = None  # when the run became non-empty

    def __contains__(self, index: int) -> bool:
        return index < self.next_line or index in self._resolved

    def __len__(self) -> int:
        return len(self._resolved)

    def add(self, outcome: Outcome, now_s: float) -> bool:
        """Keep ``outcome``; False (nothing kept) when its line has one already."""
        if outcome.index in self:
            return False
        self._resolved[outcome.index] = outcome
        while self._run_end in self._resolved:
            self._run_bytes += self._resolved[self._run_end].size_bytes
            self._run_end += 1
            if self._run_since_s is None:
                self._run_since_s = now_s
        return True

    @property
    def run_lines(self) -> int:
        return self._run_end - self.next_line

    @property
    def run_bytes(self) -> int:
        return self._run_bytes

    def run_age_s(self, now_s: float) -> float:
        return 0.0 if self._run_since_s is None else now_s - self._run_since_s

    def oldest_reply_offset(self) -> int | None:
        """The least reply offset among the outcomes held (their answers must stay readable
        until they are written)."""
        offsets = [o.reply_offset for o in self._resolved.values() if o.reply_offset is not None]
        return min(offsets, default=None)

    def take(self) -> list[Outcome]:
        """The contiguous run (at most ``segment_lines`` of it), removed from here."""
        end = min(self._run_end, self.next_line + self._segment_lines)
        taken = [self._resolved.pop(index) for index in range(self.next_line, end)]
        self.next_line = end
        self._run_bytes -= sum(o.size_bytes for o in taken)
        self._run_since_s = None if end == self._run_end else self._run_since_s
        return taken


@dataclass(frozen=True, slots=True)
class Segment:
    """A written segment: lines ``[first, end)``, what they counted, where ``end`` starts."""

    first: int
    end: int
    end_byte: int
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int


async def write_segment(store: ObjectStore, batch_id: str, outcomes: list[Outcome]) -> Segment:
    first, end = outcomes[0].index, outcomes[-1].index + 1
    output = [o.output for o in outcomes if o.output is not None]
    errors = [o.error for o in outcomes if o.error is not None]
    await store.put(segment_key(batch_id, first, end, OUT), _chunks(output))
    await store.put(segment_key(batch_id, first, end, ERR), _chunks(errors))
    return Segment(
        first=first,
        end=end,
        end_byte=outcomes[-1].end_byte,
        completed=len(output),
        failed=len(errors),
        input_tokens=sum(o.input_tokens for o in outcomes),
        output_tokens=sum(o.output_tokens for o in outcomes),
    )


async def _chunks(lines: list[bytes]) -> AsyncIterator[bytes]:
    if lines:
        yield b"".join(lines)


def segment_ranges(segment_ends: list[int]) -> list[tuple[int, int]]:
    starts = [0, *segment_ends[:-1]]
    return list(zip(starts, segment_ends, strict=True))


async def compose(
    store: ObjectStore, batch_id: str, segment_ends: list[int], kind: str, key: str
) -> int:
    """Write the ``kind`` lines of every segment, in order, as one object under ``key``; its
    size in bytes."""

    async def every_segment() -> AsyncIterator[bytes]:
        for first, end in segment_ranges(segment_ends):
            async for chunk in store.get(segment_key(batch_id, first, end, kind)):
                yield chunk

    return await store.put(key, every_segment())


async def delete_segments(store: ObjectStore, batch_id: str) -> None:
    """Every segment of the batch, those a checkpoint names and any a crash left behind."""
    for key in await store.keys(segment_prefix(batch_id)):
        await store.delete(key)
