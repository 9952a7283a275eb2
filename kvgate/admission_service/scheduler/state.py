"""The scheduler's state and the small accounting helpers every phase shares."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.admission_service.scheduler.config import (
    AdmissionPricing,
    CacheConfig,
    ModelShape,
    PreemptionMode,
    SchedulerConfig,
)
from kvgate.admission_service.scheduler.kv import BlockPool
from kvgate.admission_service.scheduler.queues import RunningSet, WaitingQueue
from kvgate.admission_service.scheduler.request import Request, RequestStatus
from kvgate.protocol.step import SnapshotAdopt, SnapshotExport, StepPlan


@dataclass(slots=True)
class SchedulerState:
    config: SchedulerConfig
    cache: CacheConfig
    model: ModelShape
    pool: BlockPool
    requests: dict[str, Request] = field(default_factory=dict)
    waiting: WaitingQueue = field(default_factory=WaitingQueue)
    running: RunningSet = field(default_factory=RunningSet)
    step: int = 0
    host_blocks_used: int = 0
    next_arrival_seq: int = 0
    owed_blocks: int = 0  # sum over running requests of owed_pages × planes
    pending_free: list[str] = field(default_factory=list)
    # Migration: snapshots to hand out (a drain) and staged imports to take in, next plan.
    pending_exports: list[SnapshotExport] = field(default_factory=list)
    pending_adopts: list[SnapshotAdopt] = field(default_factory=list)
    deadlines: list[tuple[float, int, str]] = field(default_factory=list)  # heap
    inflight: dict[int, StepPlan] = field(default_factory=dict)
    prefill_steps_since_decode: int = 0
    steps_without_progress: int = 0

    # --- accounting helpers ------------------------------------------------------------------
    @property
    def num_planes(self) -> int:
        return self.model.num_loops

    @property
    def watermark_blocks(self) -> int:
        return int(self.config.watermark_ratio * self.cache.num_blocks)

    @property
    def preemption_enabled(self) -> bool:
        return self.config.preemption is not PreemptionMode.OFF

    def capacity_pages(self, request: Request) -> int:
        return self.pool.pages_for(request.capacity_tokens)

    def prefill_cost_per_token(self) -> int:
        """Loop passes one prefill token costs in a row (the step budget counts token passes)."""
        return 1 if self.config.wavefront_prefill else self.num_planes

    def first_chunk_tokens(self, fill_tokens: int) -> int:
        budget_tokens = self.config.max_num_batched_tokens // self.prefill_cost_per_token()
        return max(1, min(fill_tokens, self.config.prefill_chunk_size, budget_tokens))

    def owed_target_pages(self, request: Request) -> int:
        """Pages a running request was promised at admission: its whole fill while it fills
        under ``fill`` pricing (so admitting others never strands a prompt half-way), its whole
        capacity when preemption is off (nothing could make room later), nothing otherwise
        (growth is recovered by preemption)."""
        if not self.preemption_enabled:
            return self.capacity_pages(request)
        if request.fill is not None and self.config.admission_pricing is AdmissionPricing.FILL:
            return self.pool.pages_for(request.fill.length)
        return 0

    def refresh_owed(self, request: Request) -> None:
        owed = 0
        if request.status is RequestStatus.RUNNING:
            held = self.pool.num_pages(request.request_id)
            owed = max(0, self.owed_target_pages(request) - held)
        self.owed_blocks += (owed - request.owed_pages) * self.num_planes
        request.owed_pages = owed

    def grow(self, request: Request, num_pages: int) -> list[tuple[int, ...]] | None:
        pages = self.pool.grow(request.request_id, num_pages)
        if pages:
            self.refresh_owed(request)
        return pages

    def release_blocks(self, request: Request) -> int:
        """Release a running request's table; returns how many pages it held."""
        self.owed_blocks -= request.owed_pages * self.num_planes
        request.owed_pages = 0
        return len(self.pool.release(request.request_id))

    def mark_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.add(request)
        self.refresh_owed(request)

    def unresolved(self, request: Request) -> bool:
        """Its last rows are still in flight (async scheduling): their outcome is unknown."""
        return request.inflight_step is not None and request.inflight_step < self.step
