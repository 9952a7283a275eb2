"""Rank 0 tells the other ranks what to do next, over a gloo group of its own.

```
rank 0:    header [command, payload bytes] ──broadcast──▶ every rank
           payload (uint8, the StepPlan's JSON) ──broadcast──▶ every rank (if any)
```
The control group is gloo on every device kind (a plan is bytes on the host) with a timeout
long enough for an idle executor: a follower waits here between plans for as long as no plan
comes. A peer that dies closes its sockets, which fails the waiting collective at once.
"""

from __future__ import annotations

from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

# A follower waits for the next plan this long at most before it gives up on rank 0.
IDLE_TIMEOUT = timedelta(days=7)


class Command(IntEnum):
    EXECUTE = 1  # payload: a StepPlan as JSON
    RESET = 2
    CALIBRATE = 3
    STOP = 4


class ControlChannel:
    def __init__(self, group: dist.ProcessGroup):
        self._group = group

    @classmethod
    def create(cls) -> ControlChannel:
        """Collective: every rank of the default group calls it once, in the same order."""
        group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        assert isinstance(group, dist.ProcessGroup)  # every rank is a member
        return cls(group)

    def send(self, command: Command, payload: bytes = b"") -> None:
        """On rank 0."""
        header = torch.tensor([int(command), len(payload)], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._group)
        if payload:
            body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(body, src=0, group=self._group)

    def receive(self) -> tuple[Command, bytes]:
        """On every other rank: the next command and its payload."""
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._group)
        command, size = Command(int(header[0])), int(header[1])
        if not size:
            return command, b""
        body = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(body, src=0, group=self._group)
        return command, body.numpy().tobytes()
