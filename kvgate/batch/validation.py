"""A batch's ``validating`` phase: one streamed pass over its input file.

What fails the whole batch (OpenAI's ``errors``, status ``failed``): the file is gone, it has no
request, more lines or bytes than the limits, or a ``custom_id`` twice (outputs could not be
told apart). What fails one line only (an error-file line, while the rest runs) is decided when
the line is read: not JSON, not a request, another url, a body the door refuses.

Memory: one line at a time, and 8 bytes per ``custom_id`` (a digest), at most
``max_file_lines`` of them: 50,000 lines hold well under 5 MB.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kvgate.batch.jsonl import Line, LineSplitter
from kvgate.batch.objects import BatchError
from kvgate.batch.settings import BatchSettings
from kvgate.batch.store import ObjectMissing, ObjectStore, file_key


@dataclass(frozen=True, slots=True)
class Validated:
    total: int  # lines that are not blank
    errors: list[BatchError]  # empty: the batch may run


async def validate_input(store: ObjectStore, file_id: str, settings: BatchSettings) -> Validated:
    splitter = LineSplitter(max_line_bytes=settings.max_line_bytes)
    checker = _Checker(settings.max_file_lines)
    size = 0
    try:
        async for chunk in store.get(file_key(file_id)):
            size += len(chunk)
            if size > settings.max_file_bytes:
                message = f"the input file is larger than {settings.max_file_bytes} bytes"
                failed = BatchError(code="file_too_large", message=message)
                return Validated(checker.total, [failed])
            for line in splitter.feed(chunk):
                if checker.check(line):
                    return checker.result()
        last = splitter.finish()
        if last is not None:
            checker.check(last)
    except ObjectMissing:
        message = f"the input file {file_id} no longer exists"
        return Validated(0, [BatchError(code="file_not_found", message=message)])
    return checker.result()


class _Checker:
    def __init__(self, max_lines: int) -> None:
        self.max_lines = max_lines
        self.total = 0
        self.errors: list[BatchError] = []
        self._seen: dict[bytes, int] = {}  # custom_id digest -> its first line

    def check(self, line: Line) -> bool:
        """Count ``line``; True when the batch has failed for good (stop reading)."""
        if line.blank:
            return False
        self.total += 1
        if self.total > self.max_lines:
            message = f"the input file has more than {self.max_lines} requests"
            self.errors = [BatchError(code="too_many_requests", message=message)]
            return True
        custom_id = _custom_id(line.data)
        if custom_id is None:
            return False  # the line fails alone, when it is read
        digest = hashlib.blake2b(custom_id.encode(), digest_size=8).digest()
        first = self._seen.setdefault(digest, line.index)
        if first != line.index:
            self.errors.append(
                BatchError(
                    code="duplicate_custom_id",
                    message=f"custom_id {custom_id[:64]!r} is also on line {first + 1}",
                    param="custom_id",
                    line=line.index + 1,
                )
            )
        return len(self.errors) >= _MAX_ERRORS

    def result(self) -> Validated:
        if self.total == 0 and not self.errors:
            empty = BatchError(code="empty_file", message="the input file has no request")
            return Validated(0, [empty])
        return Validated(self.total, self.errors)


_MAX_ERRORS = 100  # reported at most; the batch fails either way


def _custom_id(data: bytes | None) -> str | None:
    if data is None:
        return None
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    value = raw.get("custom_id") if isinstance(raw, dict) else None
    return value if isinstance(value, str) else None
