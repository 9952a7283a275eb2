"""The scheduler's state and the small accounting helpers every phase shares."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.admission_service.scheduler.config import (
    CacheConfig,
    ModelShape,
    PreemptionMode,
    SchedulerConfig,
)
from kvgate.admission_service.scheduler.kv import BlockPool
from kvgate.admission_service.scheduler.queues import RunningSet, WaitingQueue
from kvgate.admission_service.scheduler.request import Request, RequestStatus
from kvgate.gpu_executor.api import StepPlan


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
    # Preemption off: growth each running request may still claim (it was priced at admission).
    reserved_growth_blocks: int = 0
    pending_free: list[str] = field(default_factory=list)
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

    def growth_still_reserved(self, request: Request) -> int:
        """Blocks ``request`` may still grow by (priced when preemption is off)."""
        missing = self.capacity_pages(request) - self.pool.num_pages(request.request_id)
        return max(0, missing) * self.num_planes

    def grow(self, request: Request, num_pages: int) -> list[tuple[int, ...]] | None:
        before = self.growth_still_reserved(request)
        pages = self.pool.grow(request.request_id, num_pages)
        if pages and not self.preemption_enabled:
            self.reserved_growth_blocks -= before - self.growth_still_reserved(request)
        return pages

    def release_blocks(self, request: Request) -> int:
        """Release a running request's table; returns how many pages it held."""
        if not self.preemption_enabled:
            self.reserved_growth_blocks -= self.growth_still_reserved(request)
        return len(self.pool.release(request.request_id))

    def mark_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.add(request)
        if not self.preemption_enabled:
            self.reserved_growth_blocks += self.growth_still_reserved(request)

    def unresolved(self, request: Request) -> bool:
        """Its last rows are still in flight (async scheduling): their outcome is unknown."""
        return request.inflight_step is not None and request.inflight_step < self.step
