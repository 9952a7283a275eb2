"""Serialised, coalescing reconcile passes: at most one pass per pool at a time.

Triggers arrive in bursts (every executor pod reports several status changes while it starts).
A trigger that arrives during a pass waits for it and then runs one more pass; every trigger
waiting at that moment is answered by that same pass. So each trigger is followed by a pass that
*started after it* (nothing is missed), and a burst costs two passes, not one each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

_Outcome = TypeVar("_Outcome")


@dataclass
class _Pool(Generic[_Outcome]):
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiters: int = 0
    requested: int = 0  # triggers so far
    served: int = 0  # triggers answered by the last finished pass
    last: _Outcome | None = None


class PassRunner(Generic[_Outcome]):
    def __init__(self, run_pass: Callable[[str, str], Awaitable[_Outcome]]) -> None:
        self._run_pass = run_pass
        self._pools: dict[tuple[str, str], _Pool[_Outcome]] = {}

    async def run(self, namespace: str, name: str) -> _Outcome:
        """The outcome of a pass over pool ``namespace/name`` that started after this call."""
        key = (namespace, name)
        pool = self._pools.setdefault(key, _Pool())
        pool.waiters += 1
        pool.requested += 1
        ticket = pool.requested
        try:
            async with pool.lock:
                if pool.served >= ticket and pool.last is not None:
                    return pool.last
                covers = pool.requested  # every trigger so far sees this pass's reads
                outcome = await self._run_pass(namespace, name)
                pool.served, pool.last = covers, outcome
                return outcome
        finally:
            pool.waiters -= 1
            if pool.waiters == 0:
                del self._pools[key]  # idle pools keep no state
