"""Bodies of the admission service's admin HTTP API (pydantic only; the operator imports them).

```
GET  /v1/executors                 -> ExecutorMembership
PUT  /v1/executors                 <- ExecutorSet        (replace membership; admin token)
POST /v1/executors/{name}/drain    -> ExecutorStatus     (no new admissions; running work moves
                                                          to other executors by recompute)
GET  /v1/executors/{name}          -> ExecutorStatus     (state == "drained" once it is empty)
GET  /healthz  /readyz  /metrics
```

Mutations require ``Authorization: Bearer <admin token>``; a bad body is answered 400/422 with an
``AdminError`` naming the problem.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ExecutorState(StrEnum):
    CONNECTING = "connecting"
    READY = "ready"
    DRAINING = "draining"
    DRAINED = "drained"
    LOST = "lost"


class ExecutorSpec(_Body):
    """One executor the admission service should use: a name and its step endpoint URL."""

    name: Annotated[
        str, Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    ]
    endpoint: Annotated[str, Field(pattern=r"^wss?://")]
    draining: bool = False


class ExecutorSet(_Body):
    executors: list[ExecutorSpec]


class ExecutorStatus(_Body):
    name: str
    endpoint: str
    state: ExecutorState
    running_requests: Annotated[int, Field(ge=0)]
    waiting_requests: Annotated[int, Field(ge=0)]
    kv_blocks_used: Annotated[int, Field(ge=0)]
    kv_blocks_total: Annotated[int, Field(ge=0)]


class QueueLoad(_Body):
    """The service's queue as the autoscaler reads it."""

    # Records of the requests topic not yet committed, over the partitions this service owns
    # (read and unanswered ones included); as of the last fetch.
    consumer_lag: Annotated[int, Field(ge=0)]
    # Requests read and queued with no executor to run on (e.g. while the pool has none).
    unplaced: Annotated[int, Field(ge=0)]


class ExecutorMembership(_Body):
    executors: list[ExecutorStatus]
    queue: QueueLoad | None = None  # absent from services that do not report it


class AdminError(_Body):
    error: str
    detail: str | None = None
