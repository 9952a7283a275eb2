"""One record the service writes (a result, a dead letter, a token chunk, or a reply copy of
one), shared by the commit cycles (``outbox.py``) and the token stream (``token_stream.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.admission_service.replies import reply_headers
from kvgate.protocol.records import DeadLetter, ReplyTo


@dataclass(frozen=True, slots=True)
class OutRecord:
    topic: str
    partition: int | None
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    letter: DeadLetter | None = None  # on a dead letter: what its headers say
    reply: bool = False  # a copy to a reply address: skipped when unroutable (replies.py)


def reply_record(reply: ReplyTo, key: bytes, value: bytes, kind: bytes) -> OutRecord:
    """A copy of an answer or a token chunk for ``reply`` (``kind``: ``REPLY_KIND_RESULT`` or
    ``REPLY_KIND_TOKEN``, in the record's headers)."""
    return OutRecord(reply.topic, reply.partition, key, value, reply_headers(kind), reply=True)
