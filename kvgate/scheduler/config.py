"""Scheduler and cache settings: typed, validated, with the names the workload files use."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvgate.protocol.tenants import TenantName


class Policy(StrEnum):
    """Admission order. ``priority``: (priority, arrival); ``fcfs``: arrival only."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class Mode(StrEnum):
    """``refill``: a step holds prefill rows or decode rows; ``mixed``: both in one forward."""

    REFILL = "refill"
    MIXED = "mixed"


class PreemptionMode(StrEnum):
    """How a preempted request keeps its work. ``off`` never preempts."""

    OFF = "off"
    SNAPSHOT = "snapshot"
    RECOMPUTE = "recompute"
    AUTO = "auto"


class AdmissionPricing(StrEnum):
    """What admission must find free before starting a request (allocation is incremental).

    ``fill``: the request's whole fill plus the fill still owed to running requests, so admitting
    never strands a prompt half-way; ``first_chunk``: only the first chunk, relying on preemption
    for the rest (vLLM-style optimism). Decode growth is recovered by preemption in both."""

    FILL = "fill"
    FIRST_CHUNK = "first_chunk"


class Fairness(StrEnum):
    """Order within a priority class between tenants. ``off``: none (arrival or deadline order
    alone); ``tokens``: token-weighted fair sharing, by a virtual token counter per tenant
    (prefill and decode tokens over the tenant's weight), as in "Fairness in Serving Large
    Language Models" (OSDI 2024): the backlogged tenant with the smallest counter goes first."""

    OFF = "off"
    TOKENS = "tokens"


TenantWeight = Annotated[float, Field(gt=0.0, le=1e6)]


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CacheConfig(_Settings):
    """The KV geometry the scheduler accounts for (reported by the executor it plans for)."""

    num_blocks: Annotated[int, Field(ge=1)]
    block_size: Annotated[int, Field(ge=1, le=1024)] = 16
    host_snapshot_blocks: Annotated[int, Field(ge=0)] = 0
    enable_prefix_caching: bool = True


class ModelShape(_Settings):
    """What the scheduler must know about the model: loop depth and the end-of-sequence id."""

    num_loops: Annotated[int, Field(ge=1, le=64)] = 1
    eos_token_id: Annotated[int, Field(ge=0)] | None = None
    max_model_len: Annotated[int, Field(ge=1)] | None = None


class SchedulerConfig(_Settings):
    """Every scheduler setting, by the name workload files and the ExecutorPool CRD use."""

    max_num_seqs: Annotated[int, Field(ge=1, le=65536)] = 64
    max_num_batched_tokens: Annotated[int, Field(ge=1)] = 512
    prefill_chunk_size: Annotated[int, Field(ge=1)] = 256
    max_admission_bypasses: Annotated[int, Field(ge=0)] = 8
    admission_scan_limit: Annotated[int, Field(ge=1)] = 64
    policy: Policy = Policy.PRIORITY
    mode: Mode = Mode.MIXED
    wavefront_prefill: bool = False
    incremental_allocation: bool = True
    admission_pricing: AdmissionPricing = AdmissionPricing.FILL
    preemption: PreemptionMode = PreemptionMode.AUTO
    async_scheduling: bool = False
    watermark_ratio: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.01
    min_residency_steps: Annotated[int, Field(ge=0)] = 4
    # Admission keeps free what the running requests ahead of a candidate may grow into within
    # this many steps, so a start is not undone by their growth (0 turns the reserve off).
    growth_reserve_steps: Annotated[int, Field(ge=0)] = 8
    stall_steps: Annotated[int, Field(ge=1)] = 256
    max_prefill_steps_before_decode: Annotated[int, Field(ge=1)] = 1
    # Order within a priority class (docs/scheduler.md, "Tenants and deadlines"): fair sharing
    # between tenants by weight (a tenant not listed weighs default_tenant_weight), and
    # earliest-deadline-first, where a request without a deadline is ordered as if it had one
    # deadline_slack_s after its arrival (it never expires for it).
    fairness: Fairness = Fairness.OFF
    tenant_weights: dict[TenantName, TenantWeight] = Field(default_factory=dict)
    default_tenant_weight: TenantWeight = 1.0
    # A tenant that becomes backlogged starts up to this many tokens (at weight 1; more at a
    # larger weight) below the backlogged tenants' least counter — at least its first
    # request's cost: what it was under its share may be served at once (0: one request).
    fair_burst_tokens: Annotated[int, Field(ge=0)] = 2048
    deadline_order: bool = False
    deadline_slack_s: Annotated[float, Field(gt=0.0)] = 600.0
    # The background class (docs/scheduler.md, "Background work"): requests whose priority is at
    # least background_priority (batch lines) run in what the rest leaves. While a request of a
    # more important class runs or waits, the background holds at most background_step_tokens
    # running requests and its rows get at most that many token passes of a step (never none,
    # so a running background request keeps progressing); alone, it has the whole step.
    # Without wavefront prefill the scheduler raises it to the loop count (one prefill token at
    # every loop). None: no background class.
    background_priority: int | None = None
    background_step_tokens: Annotated[int, Field(ge=1)] = 2
    # auto restore-mode cost model: seconds to move one block to host and back, and seconds of
    # compute per token per loop pass when recomputing. Executors report measured figures.
    snapshot_block_cost_s: Annotated[float, Field(gt=0.0)] = 2e-5
    recompute_token_pass_cost_s: Annotated[float, Field(gt=0.0)] = 5e-5

    @model_validator(mode="after")
    def _chunk_fits_budget(self) -> SchedulerConfig:
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            raise ValueError(
                f"prefill_chunk_size ({self.prefill_chunk_size}) exceeds "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        if self.background_priority is not None and self.policy is not Policy.PRIORITY:
            raise ValueError(
                f"background_priority needs policy: priority (under {self.policy.value} every "
                "request is one class)"
            )
        return self
