"""The shared retry delay: exponential, capped, jittered within [ceiling/2, ceiling]."""

from __future__ import annotations

import random

import pytest

from kvgate.backoff import backoff_ceiling_s, jittered_delay_s


def test_ceilings_double_from_the_initial_delay_up_to_the_cap() -> None:
    ceilings = [backoff_ceiling_s(n, initial_s=0.2, max_s=5.0) for n in range(8)]
    assert ceilings == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0])
    assert backoff_ceiling_s(10**6, initial_s=1e-9, max_s=60.0) == 60.0  # no overflow


def test_every_draw_lies_in_its_bounds_and_the_draws_spread() -> None:
    rng = random.Random(7)
    for retry in range(12):
        ceiling = backoff_ceiling_s(retry, initial_s=0.1, max_s=2.0)
        draws = [
            jittered_delay_s(retry, initial_s=0.1, max_s=2.0, uniform=rng.uniform)
            for _ in range(500)
        ]
        assert all(ceiling / 2 <= d <= ceiling for d in draws)
        # Jitter, not a constant: the draws cover most of the interval.
        assert max(draws) - min(draws) > 0.8 * (ceiling / 2)


def test_the_default_draw_is_random() -> None:
    draws = {jittered_delay_s(3, initial_s=1.0, max_s=60.0) for _ in range(50)}
    assert len(draws) > 40 and all(4.0 <= d <= 8.0 for d in draws)


@pytest.mark.parametrize(
    ("retry", "initial_s", "max_s", "message"),
    [
        (-1, 1.0, 2.0, "retry counts from 0"),
        (0, 0.0, 2.0, "need 0 < initial_s <= max_s"),
        (0, 3.0, 2.0, "need 0 < initial_s <= max_s"),
    ],
)
def test_bad_arguments_are_refused(
    retry: int, initial_s: float, max_s: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        backoff_ceiling_s(retry, initial_s=initial_s, max_s=max_s)
