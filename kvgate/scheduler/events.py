"""What a step tells the outside world: request events, and facts about the step itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from kvgate.protocol.enums import FinishReason, RestoreMode
from kvgate.protocol.step import PromptLogprobs, TokenLogprob
from kvgate.scheduler.policy import EvictionReason


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Scheduling facts carried with a final result."""

    preemptions: int
    restores: int
    restore_modes: tuple[RestoreMode, ...]
    bypasses: int
    recomputed_tokens: int
    arrival_step: int
    first_admitted_step: int | None
    finished_step: int


class TokenEvent(NamedTuple):
    """One sampled token (a tuple: hundreds are made per step)."""

    request_id: str
    output_index: int
    token_id: int
    exit_depth: int
    logprob: float | None = None  # when the request asked for logprobs
    top_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class PromptLogprobsEvent:
    """Log-probabilities of some prompt tokens, from a fill row of a request that asked for them
    (a recompute of the fill may report a position again, with the same values)."""

    request_id: str
    logprobs: PromptLogprobs


@dataclass(frozen=True, slots=True)
class FinishedEvent:
    request_id: str
    reason: FinishReason
    output_token_ids: tuple[int, ...]
    exit_depths: tuple[int, ...]
    stats: RequestStats


RequestEvent = TokenEvent | PromptLogprobsEvent | FinishedEvent


class AdmissionKind(StrEnum):
    """How a request entered the running set: fresh, or restored by snapshot or recompute."""

    FRESH = "fresh"
    SNAPSHOT = "snapshot"
    RECOMPUTE = "recompute"


@dataclass(frozen=True, slots=True)
class Preemption:
    victim_id: str
    requester_id: str
    reason: EvictionReason
    mode: RestoreMode
    victim_restored_step: int | None
    victim_priority_class: int
    requester_priority_class: int


@dataclass(slots=True)
class StepReport:
    """Facts about the last planned step (telemetry, invariant checks, the simulator)."""

    step_id: int
    admitted: list[tuple[str, str]] = field(default_factory=list)  # (request id, AdmissionKind)
    preemptions: list[Preemption] = field(default_factory=list)
    bypassed: list[str] = field(default_factory=list)  # one entry per bypass increment
    # The bound and the margin: configured max_admission_bypasses, and the largest bypass count
    # of a request bypassed in this step (0 when none was).
    bypass_limit: int = 0
    max_bypasses: int = 0
    prefill_tokens: int = 0
    # Prefix cache at the starts of this step: prompt tokens looked up, and found cached.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    decode_rows: int = 0
    rows: int = 0
    depths: dict[int, int] = field(default_factory=dict)  # depth -> rows (known depths only)
    blocks_used: int = 0
    blocks_free: int = 0
    num_waiting: int = 0
    num_running: int = 0
    progressed_request_ids: set[str] = field(default_factory=set)
