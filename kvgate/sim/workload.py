"""The workload file format (a public contract, documented in docs/workloads.md)."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvgate.protocol.stopping import DEFAULT_MAX_TOKENS
from kvgate.protocol.tenants import TenantName
from kvgate.scheduler.config import SchedulerConfig
from kvgate.sim.hashing import mix, text_hash


class ExitMode(StrEnum):
    FIXED = "fixed"  # every decode token runs max_loops passes
    TRACE = "trace"  # each request lists its exit depths
    HASH = "hash"  # a seeded hash of (request, position) picks the depth in [min_loops, max]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    loops: Annotated[int, Field(ge=1, le=64)] = 1
    min_loops: Annotated[int, Field(ge=1)] = 1
    exit: ExitMode = ExitMode.FIXED
    vocab_size: Annotated[int, Field(ge=2)] = 256
    seed: Annotated[int, Field(ge=0)] = 0
    eos_token_id: Annotated[int, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _loops(self) -> ModelSection:
        if self.min_loops > self.loops:
            raise ValueError(f"min_loops ({self.min_loops}) exceeds loops ({self.loops})")
        if self.eos_token_id is not None and self.eos_token_id >= self.vocab_size:
            raise ValueError("eos_token_id must be below vocab_size")
        return self


class CacheSection(_Strict):
    num_blocks: Annotated[int, Field(ge=1)]
    block_size: Annotated[int, Field(ge=1, le=1024)] = 16
    host_snapshot_blocks: Annotated[int, Field(ge=0)] = 0
    enable_prefix_caching: bool = True


class WorkloadRequest(_Strict):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    arrival_step: Annotated[int, Field(ge=0)] = 0
    prompt: list[Annotated[int, Field(ge=0)]] | None = None
    prompt_len: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] = DEFAULT_MAX_TOKENS
    priority: int = 0
    seed: Annotated[int, Field(ge=0)] = 0
    exit_depths: list[Annotated[int, Field(ge=1)]] | None = None
    ignore_eos: bool = True
    tenant: TenantName | None = None  # whose share it is served from (scheduler.fairness)
    # The step it is given up at (finish reason deadline; the run's clock is its step count).
    deadline_step: Annotated[int, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> WorkloadRequest:
        if (self.prompt is None) == (self.prompt_len is None):
            raise ValueError("give exactly one of prompt (token ids) or prompt_len")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        return self

    def prompt_tokens(self, model: ModelSection) -> tuple[int, ...]:
        """The explicit prompt, or ``prompt_len`` tokens drawn from (model seed, request id)."""
        if self.prompt is not None:
            return tuple(self.prompt)
        assert self.prompt_len is not None
        base = mix(model.seed, text_hash(self.id))
        return tuple(mix(base, i) % model.vocab_size for i in range(self.prompt_len))


class Workload(_Strict):
    model: ModelSection = ModelSection()
    cache: CacheSection
    scheduler: SchedulerConfig = SchedulerConfig()
    requests: list[WorkloadRequest]
    max_steps: Annotated[int, Field(ge=1)] = 10_000

    @model_validator(mode="after")
    def _consistent(self) -> Workload:
        ids = [r.id for r in self.requests]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"request id {dup!r} appears twice")
        for r in self.requests:
            if r.prompt is not None and max(r.prompt) >= self.model.vocab_size:
                raise ValueError(f"request {r.id!r}: prompt token id beyond vocab_size")
            if self.model.exit is ExitMode.TRACE and r.exit_depths is None:
                raise ValueError(f"request {r.id!r}: model.exit is 'trace' but no exit_depths")
        return self


class WorkloadError(ValueError):
    """A workload file that cannot be used, with the offending field named."""


def _field_path(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "(top level)"


def parse_workload(data: Any) -> Workload:
    try:
        return Workload.model_validate(data)
    except ValidationError as exc:
        lines = [f"{_field_path(e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise WorkloadError("invalid workload:\n  " + "\n  ".join(lines)) from None


def load_workload(path: Path) -> Workload:
    try:
        text = path.read_text()
    except OSError as exc:
        raise WorkloadError(f"cannot read workload {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkloadError(
            f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    return parse_workload(data)
