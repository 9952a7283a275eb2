"""Stop strings: where a request's generated text first contains one of them."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index in ``text`` where the earliest stop string starts, or None.

    The text is re-decoded from every token so far, so a stop string split across tokens (or
    across the bytes of one character) is found once its last piece arrives.
    """
    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return min(found) if found else None
