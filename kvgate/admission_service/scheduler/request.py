"""A request as the scheduler sees it: identity, ordering stamp, progress and scheduling facts."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from kvgate.admission_service.scheduler.fill import Fill
from kvgate.protocol.enums import FinishReason, RestoreMode
from kvgate.protocol.step import LoopParams, SamplingParams


class RequestStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """What a client asks for; the scheduler's input for one request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    loops: LoopParams = field(default_factory=LoopParams)
    priority: int = 0
    deadline_s: float | None = None
    traceparent: str | None = None


@dataclass(eq=False, slots=True)
class Request:
    """Mutable scheduling state of one request.

    Token positions::

        [ prompt (P) ............ | outputs ........... ]
                                    ^ position P + len(outputs) - 1 is fed next (decode cursor)

    While ``fill`` is set the request computes K/V for a prefix of that sequence (the prompt, or
    for a recompute restore ``prompt + outputs[:-1]``); afterwards it decodes one loop pass per
    row, ``depth_done`` passes into the current token.
    """

    spec: RequestSpec
    request_id: str
    key: tuple[int, ...]  # admission key: smaller is more important; victims are the largest
    priority_class: int  # the part of the key that admission preemption may compare
    arrival_seq: int
    num_loops: int  # model depth R (prompt positions run every depth)
    min_loops: int
    max_loops: int
    capacity_tokens: int  # P + max_tokens - 1: the last sampled token is never fed back
    max_tokens: int  # spec.sampling.max_tokens, read for every token
    prompt_len: int
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    fill: Fill | None = None
    depth_done: int = 0  # loop passes completed for the token at the decode cursor
    # The executor holds state for this request (device tables, or a host snapshot).
    on_executor: bool = False
    # Pages admission promised it (the rest of its fill; its whole capacity with preemption off)
    # that it does not hold yet. Admission keeps the sum of these free for it.
    owed_pages: int = 0
    # Rows whose results are not applied yet (async scheduling keeps at most one step in flight).
    inflight_step: int | None = None
    inflight_decode: bool = False
    inflight_completes_fill: bool = False
    # How it comes back after a preemption, and the snapshot it holds meanwhile.
    restore_mode: RestoreMode | None = None
    snapshot_pages: int = 0
    evicted_step: int | None = None
    evicted_by: str | None = None  # the running request whose growth evicted it
    restored_step: int | None = None
    started_step: int | None = None  # last admission or restoration
    kv_tokens_lost: int = 0  # positions with complete K/V dropped by a recompute preemption
    # Prefix cache: digests of the prompt's full pages and how many of them were offered.
    page_digests: tuple[bytes, ...] = ()
    published_pages: int = 0
    # Scheduling facts reported with the result.
    bypasses: int = 0
    num_preemptions: int = 0
    restore_modes: list[RestoreMode] = field(default_factory=list)
    recomputed_tokens: int = 0
    arrival_step: int = 0
    progress_mark: int = 0  # high-water mark of positions with complete K/V (see Scheduler)
    first_admitted_step: int | None = None
    finish_reason: FinishReason | None = None

    @property
    def cursor_position(self) -> int:
        """Position of the token the next decode pass feeds."""
        return self.prompt_len + len(self.output_token_ids) - 1

    @property
    def kv_frontier(self) -> int:
        """Positions whose K/V is complete at every depth right now."""
        if self.fill is not None:
            return self.fill.full_depth_frontier()
        return self.cursor_position if self.output_token_ids else 0

    @property
    def kv_tokens_needed(self) -> int:
        """Positions whose K/V a full restart must rebuild (the fill of a recompute restore)."""
        if not self.output_token_ids:
            return self.prompt_len
        return self.cursor_position
