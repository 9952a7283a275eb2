"""A request as the scheduler sees it: identity, ordering stamp, progress and scheduling facts,
and its fill.

The fill: chunked and wavefront prefill as a task graph over (chunk, depth).

A fill computes K/V for positions ``[0, length)``; ``[0, start)`` came from the prefix cache.
Positions are cut into chunks as they are first scheduled; every chunk runs depths ``1..R``
(positions whose required depth is lower are skipped by the executor's passes and receive copies).

Wavefront readiness, for chunk ``c`` at depth ``d``::

    depth  R |  .    .    .
           d |  ✓ ──▶(c,d)          (c, d) needs (c, d-1): its hidden state
         d-1 |  .   (c,d-1)         and (c-1, d): causal K/V at plane d
             +------------------
               c-1    c

"Done" here means put into an *earlier* step: the executor runs steps in order, so with async
scheduling a dependency may still be in flight. Readiness is computed from the state at the start
of a step, before anything of that step is selected.

Non-wavefront prefill schedules one chunk per step as a single row over depths ``1..R``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from kvgate.protocol.enums import FinishReason, RestoreMode
from kvgate.protocol.step import LoopParams, SamplingParams
from kvgate.protocol.stopping import StopRule
from kvgate.protocol.tenants import DEFAULT_TENANT

AdmissionKey = tuple[float, ...]
"""A request's place in admission order (``policy.admission_key``): smaller is more important."""


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
    tenant: str | None = None  # whose share it is served from (fairness); None: DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class RequestProgress:
    """A request lifted out of one scheduler to resume on another: by recompute, or — when
    ``snapshot_pages`` is set — from its KV exported under a ticket (a migration)."""

    spec: RequestSpec
    output_token_ids: tuple[int, ...]
    exit_depths: tuple[int, ...]
    arrival_seq: int
    bypasses: int
    preemptions: int
    kv_tokens: int = 0  # positions whose K/V it had: what a recompute restart rebuilds
    snapshot_pages: int = 0  # pages per plane of its exported snapshot (0: none exported)
    # Its deadline for ordering (deadline order: its own, else arrival + slack); None: stamp anew.
    order_deadline_s: float | None = None


@dataclass(frozen=True, slots=True)
class ImportedSnapshot:
    """A migrated request's KV staged on this scheduler's executor under ``ticket``."""

    ticket: str
    num_pages: int


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
    # Admission key: smaller is more important; victims are the largest. Fixed from its first
    # admission on; before that, under fairness, re-stamped as its tenant's share changes
    # (state.FairWaitingQueue).
    key: AdmissionKey
    priority_class: int  # the part of the key that admission preemption may compare
    arrival_seq: int
    num_loops: int  # model depth R (prompt positions run every depth)
    min_loops: int
    max_loops: int
    capacity_tokens: int  # P + max_tokens - 1: the last sampled token is never fed back
    stop: StopRule  # from spec.sampling and the model's EOS, read for every token
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
    # Ordering: its tenant, its deadline for deadline order (its own, or arrival + slack), the
    # outputs already charged to its tenant's counter, and the ticket of its live queue entry.
    tenant: str = DEFAULT_TENANT
    order_deadline_s: float = 0.0
    charged_outputs: int = 0
    queue_ticket: int = 0

    @property
    def keyed(self) -> bool:
        """Whether its key is fixed: it was admitted here once (running, or preempted)."""
        return self.first_admitted_step is not None

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


# --- the fill: chunked and wavefront prefill ------------------------------------------------
@dataclass(slots=True)
class Chunk:
    start: int
    end: int
    scheduled_depth: int = 0  # deepest depth put into a plan
    done_depth: int = 0  # deepest depth whose result was applied

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class FillTask:
    """One row to schedule over depths ``depth_first..depth_last``: ``chunk`` indexes
    ``Fill.chunks``, or is ``None`` for a new chunk of at most ``max_tokens`` from ``start``."""

    chunk: int | None
    start: int
    max_tokens: int
    depth_first: int
    depth_last: int

    @property
    def cost_per_token(self) -> int:
        return self.depth_last - self.depth_first + 1


@dataclass(slots=True)
class Fill:
    length: int
    start: int
    num_loops: int
    wavefront: bool
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def next_start(self) -> int:
        return self.chunks[-1].end if self.chunks else self.start

    @property
    def done(self) -> bool:
        return (
            bool(self.chunks)
            and self.chunks[-1].end == self.length
            and all(c.done_depth == self.num_loops for c in self.chunks)
        )

    def ready_tasks(self) -> list[FillTask]:
        """Tasks whose dependencies were scheduled in earlier steps, in position order."""
        r = self.num_loops
        if not self.wavefront:
            if self.next_start < self.length:
                return [FillTask(None, self.next_start, self.length - self.next_start, 1, r)]
            return []
        tasks: list[FillTask] = []
        for index, chunk in enumerate(self.chunks):
            depth = chunk.scheduled_depth + 1
            if depth > r:
                continue
            if index > 0 and self.chunks[index - 1].scheduled_depth < depth:
                continue
            tasks.append(FillTask(index, chunk.start, chunk.num_tokens, depth, depth))
        last_started = not self.chunks or self.chunks[-1].scheduled_depth >= 1
        if self.next_start < self.length and last_started:
            tasks.append(FillTask(None, self.next_start, self.length - self.next_start, 1, 1))
        return tasks

    def schedule(self, task: FillTask, num_tokens: int) -> tuple[Chunk, bool]:
        """Record ``task`` as planned with ``num_tokens`` tokens (a new chunk's size);
        returns the chunk and whether this row completes the fill."""
        if task.chunk is None:
            chunk = Chunk(task.start, task.start + num_tokens)
            self.chunks.append(chunk)
        else:
            chunk = self.chunks[task.chunk]
        chunk.scheduled_depth = task.depth_last
        completes = chunk.end == self.length and task.depth_last == self.num_loops
        return chunk, completes

    def complete(self, token_start: int, depth_last: int) -> None:
        """Apply the result of the row that started at ``token_start``."""
        for chunk in reversed(self.chunks):
            if chunk.start == token_start:
                chunk.done_depth = max(chunk.done_depth, depth_last)
                return
        raise KeyError(f"no fill chunk starts at position {token_start}")

    def full_depth_frontier(self) -> int:
        """End of the contiguous prefix whose K/V is complete at every depth."""
        frontier = self.start
        for chunk in self.chunks:
            if chunk.done_depth < self.num_loops:
                break
            frontier = chunk.end
        return frontier
