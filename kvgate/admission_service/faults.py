"""Crash points for fault-injection tests: ``KVGATE_CRASH_POINT=<point>:<n>``.

The process exits at once (``os._exit``, no cleanup, like a SIGKILL) the ``n``-th time it
reaches ``<point>``. Points:

``before_commit``  a commit cycle has written answers (inside the transaction, or acknowledged
                   without one) and not yet committed them with their offsets.

Unset (the default) nothing happens; reaching a point is one dictionary lookup.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Final

log = logging.getLogger(__name__)

CRASH_POINT_ENV: Final = "KVGATE_CRASH_POINT"
CRASH_EXIT_CODE: Final = 86
BEFORE_COMMIT: Final = "before_commit"
_POINTS: Final = (BEFORE_COMMIT,)


class CrashPoints:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        spec = (os.environ if env is None else env).get(CRASH_POINT_ENV, "").strip()
        self._point: str | None = None
        self._remaining = 0
        if spec:
            point, _, count = spec.partition(":")
            if point not in _POINTS or not (count or "1").isdigit():
                raise ValueError(f"{CRASH_POINT_ENV}={spec!r}: expected one of {_POINTS}[:<n>]")
            self._point = point
            self._remaining = int(count or "1")

    def reached(self, point: str) -> None:
        if point != self._point:
            return
        self._remaining -= 1
        if self._remaining <= 0:
            log.critical("crash point %s reached: exiting now", point)
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)
