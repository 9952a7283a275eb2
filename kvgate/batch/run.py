"""One batch, driven by its owner from its last durable state to the end.

```
run():  validating ─▶ validate_input ─▶ failed (errors) | in_progress
        in_progress ─▶ feed ─────────────▶ finalize ─▶ completed
                        │ cancel / expires_at
                        └─▶ give_up ─────▶ finalize ─▶ cancelled | expired
```

**feed** keeps at most ``window`` lines sent and unanswered: a line is read (streamed from the
input file, from the checkpoint's byte on) and sent only when an answer frees a place —
backpressure from the answers, never a timer. Answers arrive through :meth:`BatchRun.on_answer`
(the owner's reader of the batch reply partition) in any order; outcomes wait in
:class:`~kvgate.batch.segments.Pending` until their run is written as a segment and the
checkpoint that names it is published.

**Exactly once per line.** A line's request id is derived from the batch and the line, so the
service answers it once whoever sends it how often (a copy sent while the first is in flight or
answered is dropped as a duplicate; docs/admission-service.md). A resumed run reads the reply
partition from the checkpoint's ``results_from`` before it sends anything (answers that came
after the checkpoint are found, not asked for again), keeps the first answer of every line and
ignores the rest, and writes each line into exactly one segment (segments partition the lines;
only checkpointed ones make the files).

| A crash...                          | ... then the next owner                                |
|-------------------------------------|--------------------------------------------------------|
| before a segment's checkpoint       | reads on from the previous checkpoint; answers already |
|                                     | in the reply partition are read there, lines in flight |
|                                     | answered by their first copy; the orphan segment is    |
|                                     | deleted when the batch finalizes                       |
| after the checkpoint                | reads on from it                                       |
| while finalizing                    | composes the same files again (their ids are derived)  |

**give_up** (a cancel, or ``expires_at``): aborts every line that may be in flight — this run's,
and what a previous owner may have sent after its last checkpoint (at most ``segment_lines +
window`` lines past it) — waits up to ``abort_grace_s`` for their answers, then writes every
line still unanswered, and the rest of the file, as ``batch_cancelled`` / ``batch_expired``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from kvgate.batch.ids import error_file_id, line_request_id, output_file_id
from kvgate.batch.journal import BatchRecord, Checkpoint, FileRecord
from kvgate.batch.jsonl import Line, read_lines
from kvgate.batch.lines import LineMapper, LineRequest, Outcome
from kvgate.batch.objects import BatchStatus, FilePurpose, LineError
from kvgate.batch.segments import ERR, OUT, Pending, compose, delete_segments, write_segment
from kvgate.batch.settings import BatchSettings
from kvgate.batch.store import ObjectStore, file_key
from kvgate.batch.validation import validate_input
from kvgate.gateway.settings import ModelRoute
from kvgate.protocol.records import InferenceRequest, InferenceResult

log = logging.getLogger(__name__)

OUTPUT_EXPIRY_S = 30 * 86_400  # output and error files, unless the batch said otherwise


class RunPorts(Protocol):
    """What a run does to the world: its owner's Kafka clients and the store."""

    @property
    def store(self) -> ObjectStore: ...

    async def send(self, route: ModelRoute, request: InferenceRequest) -> None: ...

    async def abort(self, request_ids: Sequence[str]) -> None: ...

    async def publish(self, record: BatchRecord) -> None:
        """Write the batch's record (durable when this returns)."""
        ...

    async def add_file(self, record: FileRecord) -> None: ...

    def reply_position(self) -> int:
        """The next offset the reader of the batch reply partition will hand on."""
        ...

    async def replies_caught_up(self) -> None:
        """Return once the reader has handed on what the partition held when it started."""
        ...


class BatchRun:
    def __init__(
        self,
        record: BatchRecord,
        *,
        epoch: int,
        ports: RunPorts,
        mapper: LineMapper,
        settings: BatchSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.record = record
        self.epoch = epoch
        self._ports = ports
        self._mapper = mapper
        self._settings = settings
        self._clock = clock
        point = record.checkpoint
        self._pending = Pending(point.next_line, segment_lines=settings.segment_lines)
        self._outstanding: dict[int, LineRequest] = {}  # sent, not answered
        self._early: dict[int, tuple[InferenceResult, int]] = {}  # answers to lines not read
        self._read_index = point.next_line  # the next line to read
        self._exhausted = False
        # Lines a previous owner may have sent and not answered: at most a segment and a
        # window past its last checkpoint.
        self._sent_before = record.status is not BatchStatus.VALIDATING
        self._cancel_requested = False
        self._giving_up = LineError.CANCELLED  # how an aborted line is given up
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------ events
    def cancel(self) -> None:
        """The batch's cancel was read (durable): act on it at the next step."""
        self._cancel_requested = True
        self._wake.set()

    def on_answer(self, index: int, result: InferenceResult, offset: int) -> None:
        """An answer to line ``index`` read at ``offset`` of the reply partition; the first
        answer of a line counts, any other is a copy."""
        if index in self._pending:
            return
        pending = self._outstanding.pop(index, None)
        if pending is None:
            if index >= self._read_index:
                self._early.setdefault(index, (result, offset))  # sent by a previous owner
            return
        outcome = self._mapper.answer(pending, result, offset, self._giving_up)
        self._pending.add(outcome, self._clock())
        self._wake.set()

    # ------------------------------------------------------------------ the phases
    async def run(self) -> BatchRecord:
        status = self.record.status
        if status.terminal:
            return self.record
        if status is BatchStatus.VALIDATING and not await self._validate():
            return self.record
        await self._publish()  # the record under this owner's epoch
        if self.record.status is BatchStatus.FINALIZING:
            return await self._finalize(BatchStatus.COMPLETED)
        lines = self._lines()
        try:
            give_up = self._give_up_reason()
            if give_up is None:
                give_up = await self._feed(lines)
            if give_up is not None:
                await self._give_up(give_up, lines)
        finally:
            await lines.aclose()
        final = {
            None: BatchStatus.COMPLETED,
            LineError.CANCELLED: BatchStatus.CANCELLED,
            LineError.EXPIRED: BatchStatus.EXPIRED,
        }[give_up]
        return await self._finalize(final)

    async def _validate(self) -> bool:
        validated = await validate_input(
            self._ports.store, self.record.input_file_id, self._settings
        )
        now = int(self._clock())
        if validated.errors:
            await self._publish(status=BatchStatus.FAILED, failed_at=now, errors=validated.errors)
            return False
        point = self.record.checkpoint.model_copy(
            update={"results_from": self._ports.reply_position()}
        )
        await self._publish(
            status=BatchStatus.IN_PROGRESS, in_progress_at=now, total=validated.total,
            checkpoint=point,
        )  # fmt: skip
        return True

    def _lines(self) -> AsyncGenerator[Line, None]:
        point = self.record.checkpoint
        chunks = self._ports.store.get(
            file_key(self.record.input_file_id), offset_bytes=point.next_byte
        )
        return read_lines(
            chunks, max_line_bytes=self._settings.max_line_bytes,
            first_index=point.next_line, first_byte=point.next_byte,
        )  # fmt: skip

    def _give_up_reason(self) -> LineError | None:
        if self._cancel_requested or self.record.status is BatchStatus.CANCELLING:
            return LineError.CANCELLED
        if self._clock() >= self.record.expires_at:
            return LineError.EXPIRED
        return None

    async def _feed(self, lines: AsyncIterator[Line]) -> LineError | None:
        """Send lines as answers make room, write segments as they fill; the reason to give
        up, or None once every line has its outcome written."""
        await self._ports.replies_caught_up()
        window = self._settings.window
        while True:
            give_up = self._give_up_reason()
            if give_up is not None:
                return give_up
            while not self._exhausted and len(self._outstanding) < window:
                line = await anext(lines, None)
                if line is None:
                    self._exhausted = True
                    break
                await self._take(line)
            done = self._exhausted and not self._outstanding
            await self._write_due(force=done)
            if done and len(self._pending) == 0:
                return None
            await self._wait(self._next_timeout_s())

    async def _take(self, line: Line) -> None:
        """Read ``line``: its outcome when it cannot be sent or was answered already, else
        send it."""
        self._read_index = line.index + 1
        item = self._mapper.read(line)
        if isinstance(item, Outcome):
            self._pending.add(item, self._clock())
            return
        early = self._early.pop(line.index, None)
        if early is not None:
            self._pending.add(self._mapper.answer(item, *early), self._clock())
            return
        self._outstanding[line.index] = item
        await self._ports.send(item.route, item.mapped.request)

    async def _give_up(self, code: LineError, lines: AsyncIterator[Line]) -> None:
        self._giving_up = code
        if code is LineError.CANCELLED and self.record.status is not BatchStatus.CANCELLING:
            await self._publish(status=BatchStatus.CANCELLING, cancelling_at=int(self._clock()))
        await self._ports.abort(self._maybe_in_flight())
        deadline_s = self._clock() + self._settings.abort_grace_s
        while self._outstanding and self._clock() < deadline_s:
            await self._write_due(force=False)
            await self._wait(min(self._next_timeout_s(), deadline_s - self._clock()))
        for index, item in sorted(self._outstanding.items()):
            outcome = self._mapper.unanswered(index, item.end_byte, item.custom_id, code)
            self._pending.add(outcome, self._clock())
        self._outstanding.clear()
        if not self._exhausted:
            async for line in lines:
                self._read_index = line.index + 1
                self._pending.add(self._unsent(line, code), self._clock())
                await self._write_due(force=False)
            self._exhausted = True
        while len(self._pending):
            await self._write_due(force=True)

    def _maybe_in_flight(self) -> list[str]:
        indexes = set(self._outstanding)
        if self._sent_before:
            first = self.record.checkpoint.next_line
            horizon = first + self._settings.segment_lines + self._settings.window
            indexes.update(
                i for i in range(max(first, self._read_index), horizon) if i not in self._pending
            )
        return [line_request_id(self.record.id, i) for i in sorted(indexes)]

    def _unsent(self, line: Line, code: LineError) -> Outcome:
        """The outcome of a line read after giving up: its answer if a previous owner's copy
        was answered, else given up with ``code``."""
        item = self._mapper.read(line)
        if isinstance(item, Outcome):
            return item
        early = self._early.pop(line.index, None)
        if early is not None:
            return self._mapper.answer(item, *early, code)
        return self._mapper.unanswered(line.index, line.end_byte, item.custom_id, code)

    async def _finalize(self, final: BatchStatus) -> BatchRecord:
        """Compose the output and error files from the segments, record them, then the final
        status; then delete the segments."""
        if final is BatchStatus.COMPLETED and self.record.status is not BatchStatus.FINALIZING:
            await self._publish(status=BatchStatus.FINALIZING, finalizing_at=int(self._clock()))
        point = self.record.checkpoint
        output = await self._file(OUT, output_file_id(self.record.id), point.completed, "output")
        errors = await self._file(ERR, error_file_id(self.record.id), point.failed, "error")
        now = int(self._clock())
        stamp = {
            BatchStatus.COMPLETED: "completed_at",
            BatchStatus.CANCELLED: "cancelled_at",
            BatchStatus.EXPIRED: "expired_at",
        }[final]
        await self._publish(
            status=final, output_file_id=output, error_file_id=errors, **{stamp: now}
        )
        await delete_segments(self._ports.store, self.record.id)
        return self.record

    async def _file(self, kind: str, file_id: str, lines: int, name: str) -> str | None:
        if lines == 0:
            return None
        point = self.record.checkpoint
        size = await compose(
            self._ports.store, self.record.id, point.segment_ends, kind, file_key(file_id)
        )
        now = int(self._clock())
        expiry_s = self.record.output_expires_after_s or OUTPUT_EXPIRY_S
        await self._ports.add_file(
            FileRecord(
                id=file_id, owner=self.record.owner, filename=f"{self.record.id}_{name}.jsonl",
                purpose=FilePurpose.BATCH_OUTPUT, bytes=size, lines=lines, created_at=now,
                expires_at=now + expiry_s,
            )
        )  # fmt: skip
        return file_id

    # ------------------------------------------------------------------ segments, waiting
    async def _write_due(self, *, force: bool) -> None:
        """Write segments while one is due: full (lines or bytes), old, or ``force``."""
        settings = self._settings
        while self._pending.run_lines:
            full = (
                self._pending.run_lines >= settings.segment_lines
                or self._pending.run_bytes >= settings.segment_bytes
            )
            old = self._pending.run_age_s(self._clock()) >= settings.segment_age_s
            if not (full or old or force):
                return
            await self._write(self._pending.take())

    async def _write(self, outcomes: list[Outcome]) -> None:
        segment = await write_segment(self._ports.store, self.record.id, outcomes)
        point = self.record.checkpoint
        offsets = [
            self._pending.oldest_reply_offset(),
            min((offset for _, offset in self._early.values()), default=None),
            self._ports.reply_position(),
        ]
        checkpoint = Checkpoint(
            next_line=segment.end,
            next_byte=segment.end_byte,
            segment_ends=[*point.segment_ends, segment.end],
            completed=point.completed + segment.completed,
            failed=point.failed + segment.failed,
            usage=point.usage.plus(segment.input_tokens, segment.output_tokens),
            results_from=min(o for o in offsets if o is not None),
        )
        await self._publish(checkpoint=checkpoint)

    def _next_timeout_s(self) -> float:
        now = self._clock()
        until = self.record.expires_at - now
        if self._pending.run_lines:
            until = min(until, self._settings.segment_age_s - self._pending.run_age_s(now))
        return max(0.0, until)

    async def _wait(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout_s)
        self._wake.clear()

    async def _publish(self, **changes: Any) -> None:
        self.record = self.record.model_copy(update={**changes, "epoch": self.epoch})
        await self._ports.publish(self.record)
