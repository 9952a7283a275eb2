"""Stop strings are found from a window of the newest tokens exactly when the whole text holds
one: a byte-per-token codec (the worst case: every multi-byte character is split) checked
token by token against a search of the whole decoded text."""

from __future__ import annotations

import random

import pytest

from kvgate.admission_service.stops import find_stop, stop_window_tokens

ALPHABET = ["a", "b", " ", "é", "ß", "中", "🙂", "\n"]


def _decode(token_ids: list[int]) -> str:
    return bytes(token_ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("seed", range(40))
def test_the_window_sees_a_stop_when_the_whole_text_first_holds_it(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(ALPHABET) for _ in range(60))
    stops = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 4))) for _ in range(2)]
    token_ids = list(text.encode())
    window = stop_window_tokens(stops)
    for end in range(1, len(token_ids) + 1):
        whole = find_stop(_decode(token_ids[:end]), stops) is not None
        seen = find_stop(_decode(token_ids[max(0, end - window) : end]), stops) is not None
        assert seen == whole, (text, stops, end)
        if whole:
            break
