"""JSON lines from a stream of chunks, one line in memory at a time.

:class:`LineSplitter` is the one rule for what a line is, used by the upload (counting, and
refusing a file over the limits) and by the feeder (reading): lines end at ``\\n`` (a ``\\r``
before it is dropped); the last line needs no newline; a line longer than ``max_line_bytes`` is
reported without its bytes (they are skipped, never buffered). Byte offsets say where each line
starts and ends, so a resumed batch reads on from the first line it has not written.

```
bytes  |{"custom_id":"a",...}\\n|\\n|{"custom_id":"b",...}\\n|{...
        ^start_byte          end^  ^ a blank line          ^ next line's start_byte
index   0                          1  2
```
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Line:
    index: int  # 0-based, counting every line (blank ones too)
    start_byte: int
    end_byte: int  # after its newline: where the next line starts
    data: bytes | None  # without the line end (empty when not kept); None: over the limit
    blank: bool  # only whitespace


class LineSplitter:
    """Feed chunks, take lines. ``keep_data=False`` counts without holding any line."""

    def __init__(
        self,
        *,
        max_line_bytes: int,
        first_index: int = 0,
        first_byte: int = 0,
        keep_data: bool = True,
    ) -> None:
        self.max_line_bytes = max_line_bytes
        self.keep_data = keep_data
        self._index = first_index
        self._line_start = first_byte
        self._position = first_byte  # bytes seen so far (absolute)
        self._pending = bytearray()  # the current line's bytes (while kept)
        self._length = 0  # the current line's length so far
        self._blank = True  # the current line is whitespace so far

    def feed(self, chunk: bytes) -> list[Line]:
        lines: list[Line] = []
        start = 0
        while start < len(chunk):
            newline = chunk.find(b"\n", start)
            end = len(chunk) if newline < 0 else newline
            self._take(chunk, start, end)
            if newline < 0:
                self._position += end - start
                break
            self._position += end - start + 1
            lines.append(self._close())
            start = newline + 1
        return lines

    def finish(self) -> Line | None:
        """The last line when the stream did not end with a newline."""
        if self._position == self._line_start:
            return None
        return self._close()

    @property
    def index(self) -> int:
        """The index the next line will have."""
        return self._index

    def _take(self, chunk: bytes, start: int, end: int) -> None:
        piece = chunk[start:end]
        self._length += len(piece)
        if self._blank and piece.strip():
            self._blank = False
        if self.keep_data and self._length <= self.max_line_bytes:
            self._pending += piece

    def _close(self) -> Line:
        data: bytes | None = None
        if self._length <= self.max_line_bytes:
            data = bytes(self._pending).removesuffix(b"\r")
        line = Line(self._index, self._line_start, self._position, data, self._blank)
        self._index += 1
        self._line_start = self._position
        self._pending = bytearray()
        self._length = 0
        self._blank = True
        return line


async def read_lines(
    chunks: AsyncIterable[bytes], *, max_line_bytes: int, first_index: int = 0, first_byte: int = 0
) -> AsyncGenerator[Line, None]:
    """Every line of the stream, from ``first_index`` (which starts at ``first_byte``)."""
    splitter = LineSplitter(
        max_line_bytes=max_line_bytes, first_index=first_index, first_byte=first_byte
    )
    async for chunk in chunks:
        for line in splitter.feed(chunk):
            yield line
    last = splitter.finish()
    if last is not None:
        yield last
