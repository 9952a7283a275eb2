"""Replay a window of the request log through the simulator: records → workload → report.

Phases: validate each record with the admission service's own checks (``validate_request``),
map the accepted ones' record timestamps onto scheduler steps, build a workload file with the
pool's scheduler settings and the simulated executor's geometry, and run it as ``kvgate sim``
does. The workload is an ordinary workload file (``--workload-out``), so a replay can be kept and
rerun without the broker.

Arrival mapping: records are ordered by (timestamp, partition, offset); the first accepted
record's timestamp ``t0`` is step 0 and a record at ``t`` arrives at step
``(t - t0) // step_ms``. ``kvgate sim`` admits a request arriving at step ``s`` before planning its
``s``-th scheduler tick (one tick per loop of the run, whether or not it plans a step), so
requests that arrived within one step time of each other join the same tick.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvgate.admission_service.settings import (
    LimitsSettings,
    ServiceSettings,
    load_settings,
)
from kvgate.admission_service.tokenizer import TextCodec
from kvgate.admission_service.tracing import StepDecisions
from kvgate.admission_service.validation import (
    Accepted,
    NeedsTokens,
    RawRecord,
    Rejection,
    check_request,
    tokenized,
)
from kvgate.kafka_connection import SettingsError
from kvgate.protocol.records import RejectCode
from kvgate.protocol.step import StepPlan
from kvgate.scheduler.config import SchedulerConfig
from kvgate.scheduler.events import StepReport
from kvgate.sim.backend import SimExecutorConfig
from kvgate.sim.report import SimReport
from kvgate.sim.simulate import simulate
from kvgate.sim.workload import CacheSection, Workload, WorkloadRequest


class PoolSettingsError(ValueError):
    """A ``--config`` file that is neither a service settings file nor an ExecutorPool."""


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """What a replay takes from the pool: the scheduler and the request limits."""

    scheduler: SchedulerConfig
    limits: LimitsSettings
    source: str  # "service settings", "ExecutorPool <name>" or "defaults"
    enable_prefix_caching: bool = True
    # Whether the service read text prompts: a settings file without limits.tokenizer_file
    # says it refused them; a pool manifest or no file cannot say, so text is assumed read.
    service_tokenizes: bool = True


def load_pool_settings(path: Path | None) -> PoolSettings:
    """The admission service's settings file or an ExecutorPool manifest (YAML)."""
    if path is None:
        return PoolSettings(SchedulerConfig(async_scheduling=True), LimitsSettings(), "defaults")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PoolSettingsError(f"{path}: {exc}") from None
    if isinstance(data, dict) and data.get("kind") == "ExecutorPool":
        return _from_pool(path, data)
    try:
        service: ServiceSettings = load_settings(
            path, overrides=None if "kafka" in (data or {}) else {"kafka": _PLACEHOLDER_KAFKA}
        )
    except SettingsError as exc:
        raise PoolSettingsError(f"{path}: {exc}") from None
    return PoolSettings(
        service.scheduler,
        service.limits,
        "service settings",
        enable_prefix_caching=service.executors.enable_prefix_caching,
        service_tokenizes=service.limits.tokenizer_file is not None,
    )


# A settings file without a kafka section is still a valid source of scheduler settings.
_PLACEHOLDER_KAFKA = {"bootstrap_servers": "127.0.0.1:9092"}


def _from_pool(path: Path, data: dict[str, Any]) -> PoolSettings:
    from kvgate.operator.models import InvalidSpecError, parse_spec  # noqa: PLC0415

    name = str((data.get("metadata") or {}).get("name", ""))
    try:
        spec = parse_spec(name, data.get("spec"))
    except InvalidSpecError as exc:
        raise PoolSettingsError(f"{path}: {exc}") from None
    # The operator writes the settings the pool sets into the service's ConfigMap
    # (``exclude_unset``), and the service fills in its own defaults: the same path here.
    written = spec.scheduler.model_dump(mode="json", exclude_unset=True)
    service = load_settings(None, overrides={"kafka": _PLACEHOLDER_KAFKA, "scheduler": written})
    return PoolSettings(service.scheduler, LimitsSettings(), f"ExecutorPool {name}")


@dataclass(slots=True)
class ReplayInput:
    """The log window as the simulator sees it, and what the service would have refused."""

    workload: Workload
    records: int
    rejections: Counter[str] = field(default_factory=Counter)  # RejectCode -> records
    rejected: dict[str, str] = field(default_factory=dict)  # "partition:offset" -> reason
    skipped_text: int = 0  # text prompts without --tokenizer
    first_timestamp_ms: int | None = None


def build_workload(
    records: list[RawRecord],
    pool: PoolSettings,
    executor: SimExecutorConfig,
    *,
    step_ms: float,
    tokenizer: TextCodec | None,
    max_steps: int = 100_000,
) -> ReplayInput:
    ordered = sorted(records, key=lambda r: (r.timestamp_ms or 0, r.partition, r.offset))
    accepted: list[tuple[RawRecord, Accepted]] = []
    out = ReplayInput(workload=_empty_workload(pool, executor, max_steps), records=len(records))
    seen: set[str] = set()
    for record in ordered:
        verdict = _validate(record, pool, tokenizer)
        if verdict is None:
            out.skipped_text += 1
            continue
        if isinstance(verdict, Accepted) and verdict.request.request_id in seen:
            verdict = Rejection(
                RejectCode.DUPLICATE,
                f"request id {verdict.request.request_id!r} was read earlier in the window",
                verdict.request.request_id,
            )
        if isinstance(verdict, Rejection):
            out.rejections[verdict.code.value] += 1
            out.rejected[f"{record.partition}:{record.offset}"] = (
                f"{verdict.code.value}: {verdict.reason}"
            )
            continue
        seen.add(verdict.request.request_id)
        accepted.append((record, verdict))
    if accepted:
        out.first_timestamp_ms = accepted[0][0].timestamp_ms or 0
    requests = [
        _workload_request(item, arrival_step=_arrival_step(rec, out.first_timestamp_ms, step_ms))
        for rec, item in accepted
    ]
    try:
        out.workload = out.workload.model_copy(update={"requests": requests})
        Workload.model_validate(out.workload.model_dump())  # the file's own checks
    except ValidationError as exc:  # e.g. a token id beyond the executor's vocabulary
        raise PoolSettingsError(f"the replayed requests do not form a workload: {exc}") from None
    return out


def _validate(
    record: RawRecord, pool: PoolSettings, tokenizer: TextCodec | None
) -> Accepted | Rejection | None:
    """The service's verdict on ``record``; None for text the service read (it had a
    tokenizer) replayed without ``--tokenizer``: skipping it is honest, rejecting it would report
    a refusal that never happened, and made-up token ids would change its cost. A service
    without a tokenizer refused text, and so does its replay (the same check says so)."""
    verdict = check_request(record, pool.limits, has_tokenizer=pool.service_tokenizes)
    if isinstance(verdict, NeedsTokens):
        if tokenizer is None:
            return None
        return tokenized(verdict, tokenizer, pool.limits)
    return verdict


def _arrival_step(record: RawRecord, first_ms: int | None, step_ms: float) -> int:
    return int(((record.timestamp_ms or 0) - (first_ms or 0)) // step_ms)


def _workload_request(accepted: Accepted, *, arrival_step: int) -> WorkloadRequest:
    request = accepted.request
    return WorkloadRequest(
        id=request.request_id,
        arrival_step=max(arrival_step, 0),
        prompt=list(accepted.prompt_token_ids),
        max_tokens=request.max_tokens,
        priority=request.priority,
        seed=request.sampling.seed or 0,  # the simulated model mixes 0 for "none"
        ignore_eos=request.sampling.ignore_eos,
    )


def _empty_workload(pool: PoolSettings, executor: SimExecutorConfig, max_steps: int) -> Workload:
    return Workload(
        model=executor.model(),
        cache=CacheSection(
            num_blocks=executor.num_blocks,
            block_size=executor.block_size,
            host_snapshot_blocks=executor.host_snapshot_blocks,
            enable_prefix_caching=pool.enable_prefix_caching,
        ),
        scheduler=pool.scheduler,
        requests=[],
        max_steps=max_steps,
    )


@dataclass(slots=True)
class ReplayRun:
    report: SimReport
    decisions: list[tuple[int, StepDecisions]]  # (step id, decisions), in plan order


def run_replay(workload: Workload, *, check: bool = True) -> ReplayRun:
    decisions: list[tuple[int, StepDecisions]] = []

    def observe(plan: StepPlan, report: StepReport) -> None:
        decisions.append((plan.step_id, StepDecisions.of(plan, report)))

    report = simulate(workload, check=check, observe=observe)
    return ReplayRun(report, decisions)
