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


# Tokens decoded before the window's first whole character: a window may start inside a
# character's bytes or drop a word's leading space; this many tokens of margin cover either.
_WINDOW_MARGIN_TOKENS = 8


def stop_window_tokens(stops: Sequence[str]) -> int:
    """How many of the newest tokens hold any stop string that the newest token completes.

    A token decodes to at least one byte (only skipped special tokens to none, and the margin
    absorbs a few of those), so a stop string of ``n`` UTF-8 bytes ending in the newest token
    lies within its last ``n`` tokens.
    """
    return max(len(stop.encode()) for stop in stops) + _WINDOW_MARGIN_TOKENS
