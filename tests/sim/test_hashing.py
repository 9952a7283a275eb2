"""The simulated model's unrolled hash steps are the general one's."""

from __future__ import annotations

import random

from kvgate.sim.hashing import mix, mix2, mix3


def test_the_unrolled_mixes_equal_mix() -> None:
    draw = random.Random(5)
    values = [0, 1, -1, 2**63, 2**64 - 1, 2**64, -(2**70), 123456789]
    values += [draw.getrandbits(70) - 2**69 for _ in range(300)]
    for a, b, c in zip(values, values[1:] + values[:1], values[2:] + values[:2], strict=True):
        assert mix2(a, b) == mix(a, b)
        assert mix3(a, b, c) == mix(a, b, c)
