"""Retry delays: exponential, capped, with jitter — the one rule every retry loop uses.

Equal jitter: the ``retry``-th consecutive retry (0-based) waits a uniformly drawn time in
``[ceiling / 2, ceiling]``, where ``ceiling = min(max_s, initial_s * 2**retry)``::

    retry:      0          1            2                 ...   k (capped)
    delay:  [i/2, i]   [i, 2i]    [2i, 4i]                ...   [max/2, max]

Jitter spreads the retries of many clients that failed together (every admission service after a
broker restart, every executor handle after a network blip) so they do not come back in step;
the floor at half the ceiling keeps a failing peer from being hammered by a draw near zero (the
price: the spread is a factor of two, not the whole range "full jitter" draws from). Only the
standard library is imported here.
"""

from __future__ import annotations

import random
from collections.abc import Callable

# A draw in [low, high]; random.uniform by default, a fixed function in tests.
Uniform = Callable[[float, float], float]
_MAX_DOUBLINGS = 64  # 2**64 times any positive initial_s exceeds every sensible cap


def backoff_ceiling_s(retry: int, *, initial_s: float, max_s: float) -> float:
    """The ``retry``-th retry's longest delay: ``initial_s`` doubled ``retry`` times, capped."""
    if retry < 0:
        raise ValueError(f"retry counts from 0, got {retry}")
    if not 0 < initial_s <= max_s:
        raise ValueError(f"need 0 < initial_s <= max_s, got {initial_s} and {max_s}")
    return min(max_s, initial_s * 2.0 ** min(retry, _MAX_DOUBLINGS))


def jittered_delay_s(
    retry: int, *, initial_s: float, max_s: float, uniform: Uniform = random.uniform
) -> float:
    """The delay before the ``retry``-th retry (0-based): uniform in ``[ceiling/2, ceiling]``."""
    ceiling = backoff_ceiling_s(retry, initial_s=initial_s, max_s=max_s)
    return uniform(ceiling / 2, ceiling)
