"""Which ``SessionOpen`` an executor accepts: one rule for every executor, real or simulated.

```
accepted epochs      e1 < e2 < ... < e_max          strictly increasing; accepting one fences
                                                    out (and resets) every older session
refused              epoch <= e_max                 STALE_EPOCH
refused              epoch >  now_ms + max_lead_ms  PROTOCOL: no client can jump the sequence
refused              protocol_version not spoken    PROTOCOL
```
Admission services derive epochs from their wall clock in milliseconds (``EpochClock``), so
the ceiling ``now + max_lead`` bounds what a client holding the executor token can do: an epoch
far in the future is refused outright, and one just under the ceiling locks the real service out
for at most ``max_lead`` — its clock catches up and its next epoch is accepted again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from kvgate.protocol.step import SUPPORTED_PROTOCOL_VERSIONS, ErrorCode, ProtocolError, SessionOpen

DEFAULT_MAX_EPOCH_LEAD_S: Final = 60.0


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class EpochFence:
    """The accepted epochs of one executor, and the checks a new session must pass."""

    def __init__(
        self,
        *,
        max_lead_s: float = DEFAULT_MAX_EPOCH_LEAD_S,
        now_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        if max_lead_s <= 0:
            raise ValueError("max_lead_s must be positive")
        self.max_lead_ms = int(max_lead_s * 1000)
        self._now_ms = now_ms
        self.max_epoch: int | None = None

    def refusal(self, opening: SessionOpen) -> ProtocolError | None:
        """Why ``opening`` may not open a session; None when it may (nothing is recorded)."""
        if opening.protocol_version not in SUPPORTED_PROTOCOL_VERSIONS:
            return ProtocolError(
                code=ErrorCode.PROTOCOL,
                message=f"protocol version {opening.protocol_version}; this executor speaks "
                f"{', '.join(map(str, sorted(SUPPORTED_PROTOCOL_VERSIONS)))}",
            )
        if self.max_epoch is not None and opening.epoch <= self.max_epoch:
            return ProtocolError(
                code=ErrorCode.STALE_EPOCH,
                message=f"epoch {opening.epoch} is not newer than accepted epoch {self.max_epoch}",
            )
        ceiling = self._now_ms() + self.max_lead_ms
        if opening.epoch > ceiling:
            return ProtocolError(
                code=ErrorCode.PROTOCOL,
                message=f"epoch {opening.epoch} is more than {self.max_lead_ms} ms ahead of this "
                f"executor's clock ({ceiling - self.max_lead_ms} ms); epochs are wall-clock "
                "milliseconds",
            )
        return None

    def accept(self, opening: SessionOpen) -> ProtocolError | None:
        """Record ``opening``'s epoch when it may open a session; else say why not."""
        refusal = self.refusal(opening)
        if refusal is None:
            self.max_epoch = opening.epoch
        return refusal
