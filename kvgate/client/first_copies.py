"""What ``kvgate results`` prints once: the first copy of every answer and token chunk.

Copies are expected: without transactions a result can be written twice (a crash between its
acknowledgement and the offset commit, or a producer retry), and token chunks are always
at-least-once (a request run again after a hand-off streams its chunks from index 0 again;
docs/admission-service.md, "Delivery semantics"). A copy has the identity of the first:

    token chunk   (request_id, choice, index)  — it carries a token_id
    result        (request_id, None, None)     — anything else with a request id (one answer
                                                 per id)

A value without a request id (not JSON, another model) has no identity and is always printed.
"""

from __future__ import annotations

from collections import OrderedDict

from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError

Identity = tuple[str, int | None, int | None]
# Identities remembered; past this the oldest are forgotten (a copy that late prints again).
MAX_REMEMBERED = 200_000


class _Named(BaseModel):
    """The fields that name a record, whatever else it holds."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    request_id: str
    index: NonNegativeInt | None = None
    token_id: NonNegativeInt | None = None
    choice: NonNegativeInt = 0


def identity(value: bytes) -> Identity | None:
    try:
        named = _Named.model_validate_json(value)
    except ValidationError:
        return None
    if named.token_id is None or named.index is None:
        return named.request_id, None, None
    return named.request_id, named.choice, named.index


class FirstCopies:
    def __init__(self, max_remembered: int = MAX_REMEMBERED) -> None:
        self._seen: OrderedDict[Identity, None] = OrderedDict()
        self._max = max_remembered
        self.copies = 0  # values dropped as copies

    def first(self, value: bytes) -> bool:
        """Whether ``value`` is the first of its identity (then it is remembered)."""
        key = identity(value)
        if key is None:
            return True
        if key in self._seen:
            self.copies += 1
            return False
        self._seen[key] = None
        if len(self._seen) > self._max:
            self._seen.popitem(last=False)
        return True
