"""The ExecutorPool status: phase, executors, counts and conditions, as the CRD declares them.

Conditions follow the Kubernetes convention: one entry per ``type``; ``lastTransitionTime`` moves
only when ``status`` changes, so a reader can tell how long a pool has been (not) Ready.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class Phase(StrEnum):
    PENDING = "Pending"  # no executor ready yet
    PROGRESSING = "Progressing"  # serving, but not yet as the spec asks
    READY = "Ready"  # every executor ready at the current revision, membership in sync
    FAILED = "Failed"  # the spec is invalid; nothing is changed until it is fixed


class ConditionType(StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    ADMISSION_SYNCED = "AdmissionSynced"
    DRAINING = "Draining"
    AUTOSCALING = "Autoscaling"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class _Status(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        extra="ignore",
        alias_generator=to_camel,
        validate_by_alias=True,
        validate_by_name=True,
        serialize_by_alias=True,
    )


class ConditionUpdate(_Status):
    """What a reconcile pass says about one condition type (no timestamps)."""

    type: ConditionType
    status: ConditionStatus
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""


class Condition(ConditionUpdate):
    last_transition_time: datetime
    observed_generation: int | None = None


class ExecutorEntry(_Status):
    name: str
    slot: int | None
    revision: str | None
    endpoint: str | None
    ready: bool
    draining: bool
    # The admission replica (pod) that drives it, in pools of several replicas.
    admission: str | None = None


class RecommendationEntry(_Status):
    time: datetime
    replicas: int


class AutoscalingStatus(_Status):
    desired_replicas: int
    reason: str
    last_scale_time: datetime | None = None
    idle_since: datetime | None = None
    recommendations: list[RecommendationEntry] = []


class PoolStatus(_Status):
    phase: Phase
    observed_generation: int | None = None
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    revision: str | None = None
    selector: str | None = None
    executors: list[ExecutorEntry] = []
    autoscaling: AutoscalingStatus | None = None
    conditions: list[Condition] = []

    def to_patch(self) -> dict[str, Any]:
        """The JSON body of a status merge patch (lists replace the stored ones whole)."""
        return {"status": self.model_dump(mode="json", by_alias=True)}


def merge_conditions(
    previous: Sequence[Condition],
    updates: Iterable[ConditionUpdate],
    *,
    now: datetime,
    generation: int | None,
) -> list[Condition]:
    """Apply ``updates`` to ``previous``; untouched types keep their entry as it was."""
    merged = {condition.type: condition for condition in previous}
    for update in updates:
        before = merged.get(update.type)
        unchanged = before is not None and before.status == update.status
        merged[update.type] = Condition(
            **update.model_dump(),
            last_transition_time=before.last_transition_time if before and unchanged else now,
            observed_generation=generation,
        )
    return [merged[kind] for kind in ConditionType if kind in merged]


def parse_conditions(raw: object) -> list[Condition]:
    """Conditions from a stored status; entries this version does not know are dropped."""
    if not isinstance(raw, list):
        return []
    known = {kind.value for kind in ConditionType}
    conditions = []
    for item in raw:
        if isinstance(item, dict) and item.get("type") in known:
            try:
                conditions.append(Condition.model_validate(item))
            except ValueError:
                continue  # a malformed entry is rewritten by this pass
    return conditions
