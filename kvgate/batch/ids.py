"""Identifiers: files, batches, and the request id of each line.

A line's request id is derived from its batch and its line number (``<batch id>:<line>``), never
drawn: whichever feeder sends line 17 of a batch, before or after a restart, sends the same id,
and the admission service answers an id once (docs/admission-service.md, "Delivery semantics").
That is what lets a resumed batch send a line again without running it twice.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Final

from kvgate.protocol.records import REQUEST_ID_PATTERN

FILE_PREFIX: Final = "file-"
BATCH_PREFIX: Final = "batch_"
# What an id the gateway makes looks like: the prefix and 24 hex digits. Ids from a client are
# held to it before they are used as a key in the store or a topic.
_FILE_ID: Final = re.compile(r"file-[0-9a-f]{24}")
_BATCH_ID: Final = re.compile(r"batch_[0-9a-f]{24}")
_LINE_SEPARATOR: Final = ":"


def new_file_id() -> str:
    return f"{FILE_PREFIX}{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"{BATCH_PREFIX}{secrets.token_hex(12)}"


def is_file_id(value: str) -> bool:
    return _FILE_ID.fullmatch(value) is not None


def is_batch_id(value: str) -> bool:
    return _BATCH_ID.fullmatch(value) is not None


def output_file_id(batch_id: str) -> str:
    """The id of a batch's output file: derived, so that finalizing again (after a restart)
    writes the same file instead of a second one."""
    return f"{FILE_PREFIX}{_digest(batch_id, 'output')}"


def error_file_id(batch_id: str) -> str:
    return f"{FILE_PREFIX}{_digest(batch_id, 'errors')}"


def line_request_id(batch_id: str, line: int) -> str:
    """The Kafka request id of a batch's line (0-based ``line``)."""
    request_id = f"{batch_id}{_LINE_SEPARATOR}{line}"
    assert re.fullmatch(REQUEST_ID_PATTERN, request_id), request_id
    return request_id


def parse_line_request_id(request_id: str) -> tuple[str, int] | None:
    """(batch id, line) of a line's request id; None for any other id."""
    batch_id, separator, line = request_id.rpartition(_LINE_SEPARATOR)
    if not separator or not is_batch_id(batch_id) or not line.isdigit():
        return None
    return batch_id, int(line)


def output_line_id(batch_id: str, line: int) -> str:
    """The ``id`` of a line in the output or error file (OpenAI's ``batch_req_...``)."""
    return f"batch_req_{_digest(batch_id, str(line))}"


def _digest(*parts: str) -> str:
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=12).hexdigest()
