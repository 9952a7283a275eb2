"""One record the service writes (a result, a dead letter, a token chunk, or a reply copy of
one), shared by the commit cycles (``outbox.py``) and the token stream (``token_stream.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.admission_service.replies import reply_headers
from kvgate.protocol.records import REPLY_KIND_RESULT, DeadLetter, ReplyTo


@dataclass(frozen=True, slots=True)
class OutRecord:
    topic: str
    partition: int | None
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    letter: DeadLetter | None = None  # on a dead letter: what its headers say
    reply: bool = False  # a copy to a reply address: skipped when unroutable (replies.py)


def reply_record(reply: ReplyTo, key: bytes, value: bytes) -> OutRecord:
    """A copy of a result for ``reply`` (header ``kvgate-reply-kind: result``; token chunks'
    copies are the token stream's, ``token_stream.py``)."""
    return OutRecord(
        reply.topic, reply.partition, key, value, reply_headers(REPLY_KIND_RESULT), reply=True
    )
