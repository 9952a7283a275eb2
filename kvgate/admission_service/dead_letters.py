"""Dead-letter records that always fit: the original when it fits, else a truncated copy.

A dead letter must never be refused for its size, or its partition stops (every later answer
waits behind it). The room a dead letter has is the smaller of the service producer's request
limit and the dead-letter topic's ``max.message.bytes``, both known at start-up
(``kafka_io.TopicLimits``); any record that can be read can be described within it::

    fits:        key, value and headers as read, plus the kvgate-dlq-* headers
    too large:   value = the original's first bytes (at most TRUNCATED_VALUE_BYTES),
                 key and original headers kept only if small, plus
                 kvgate-dlq-truncated / -original-bytes / -sha256 (of the whole original value)
                 and the topic/partition/offset to read the original from

Sizes are estimated the way Kafka's record format spends them, rounded up.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

from kvgate.protocol.records import DeadLetter

# What one record of a batch costs beyond its key, value and header bytes, rounded up (the
# batch header is 61 bytes; a record's varints and attributes are at most ~25, each header's ~10).
RECORD_OVERHEAD_BYTES: Final = 128
HEADER_OVERHEAD_BYTES: Final = 16
# A truncated copy keeps this much of the original value: enough to recognise the producer and
# the payload, small enough that a flood of huge records does not pile up in memory.
TRUNCATED_VALUE_BYTES: Final = 64 * 1024
# Above these, an oversized record's own key and headers are dropped too (their size is noted).
KEPT_KEY_BYTES: Final = 1024
KEPT_HEADER_BYTES: Final = 16 * 1024
# The least room the dead-letter topic must give (checked at start-up): the kvgate-dlq-* headers,
# a reason, a kept key and a small prefix.
MIN_DEAD_LETTER_BYTES: Final = 8 * 1024

Headers = list[tuple[str, bytes]]


@dataclass(frozen=True, slots=True)
class DeadLetterCopy:
    key: bytes | None
    value: bytes
    headers: Headers
    letter: DeadLetter  # what its kvgate-dlq-* headers say

    @property
    def truncated(self) -> bool:
        return self.letter.truncated


def record_bytes(key: bytes | None, value: bytes | None, headers: Headers) -> int:
    """An upper bound on what the record costs on the wire."""
    size = RECORD_OVERHEAD_BYTES + len(key or b"") + len(value or b"")
    return size + sum(HEADER_OVERHEAD_BYTES + len(k.encode()) + len(v) for k, v in headers)


def dead_letter_copy(
    key: bytes | None,
    value: bytes | None,
    headers: Headers,
    letter: DeadLetter,
    *,
    max_bytes: int,
) -> DeadLetterCopy:
    """The dead letter for a record (its key, value, headers) with ``letter``'s headers, in at
    most ``max_bytes`` (which must be at least ``MIN_DEAD_LETTER_BYTES``)."""
    whole = [*headers, *letter.headers()]
    if value is None:
        value = b""
    if record_bytes(key, value, whole) <= max_bytes:
        return DeadLetterCopy(key, value, whole, letter)
    described = letter.model_copy(
        update={
            "truncated": True,
            "original_bytes": len(value),
            "sha256": hashlib.sha256(value).hexdigest(),
            "reason": _short(letter.reason),
        }
    )
    kept_key = key if key is not None and len(key) <= KEPT_KEY_BYTES else None
    kept_headers = headers if record_bytes(None, None, headers) <= KEPT_HEADER_BYTES else []
    out_headers = [*kept_headers, *described.headers()]
    room = max_bytes - record_bytes(kept_key, b"", out_headers)
    if room < 0:  # only when max_bytes is below the minimum: keep the description alone
        kept_key, out_headers = None, described.headers()
        room = max(0, max_bytes - record_bytes(None, b"", out_headers))
    prefix = value[: min(room, TRUNCATED_VALUE_BYTES)]
    return DeadLetterCopy(kept_key, prefix, out_headers, described)


def _short(reason: str, limit: int = 512) -> str:
    return reason if len(reason) <= limit else reason[: limit - 1] + "…"
