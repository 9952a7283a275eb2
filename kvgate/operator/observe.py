"""Raw API objects become the small typed facts the planner reasons about (the parse boundary).

Nothing here calls the API; ``reconciler`` fetches, these functions read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from kvgate.operator.naming import ANNOTATION_DRAINING_SINCE, LABEL_REVISION, LABEL_SLOT
from kvgate.operator.status import Condition, parse_conditions

RawObject = dict[str, Any]  # a Kubernetes object as the API serves it (JSON)


class PodPhase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


@dataclass(frozen=True)
class ObservedPod:
    """One executor Pod as the planner needs it."""

    name: str
    uid: str
    slot: int | None  # None: the slot label is missing or not a number
    revision: str | None
    phase: PodPhase
    ready: bool
    pod_ip: str | None
    terminating: bool  # deletionTimestamp is set: its name is taken until it is gone
    draining_since: datetime | None


@dataclass(frozen=True)
class ObservedPool:
    name: str
    namespace: str
    uid: str
    generation: int | None
    deleting: bool
    spec: Mapping[str, Any] | None
    conditions: list[Condition]
    status: Mapping[str, Any]


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _timestamp(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _slot(value: object) -> int | None:
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def observe_pod(raw: Mapping[str, Any]) -> ObservedPod:
    meta = _mapping(raw.get("metadata"))
    labels = _mapping(meta.get("labels"))
    annotations = _mapping(meta.get("annotations"))
    status = _mapping(raw.get("status"))
    conditions = status.get("conditions")
    ready = isinstance(conditions, list) and any(
        isinstance(item, Mapping) and item.get("type") == "Ready" and item.get("status") == "True"
        for item in conditions
    )
    try:
        phase = PodPhase(status.get("phase", PodPhase.PENDING))
    except ValueError:
        phase = PodPhase.UNKNOWN
    pod_ip = status.get("podIP")
    revision = labels.get(LABEL_REVISION)
    return ObservedPod(
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        slot=_slot(labels.get(LABEL_SLOT)),
        revision=revision if isinstance(revision, str) else None,
        phase=phase,
        ready=ready and phase is PodPhase.RUNNING,
        pod_ip=pod_ip if isinstance(pod_ip, str) and pod_ip else None,
        terminating=meta.get("deletionTimestamp") is not None,
        draining_since=_timestamp(annotations.get(ANNOTATION_DRAINING_SINCE)),
    )


def observe_pool(raw: Mapping[str, Any]) -> ObservedPool:
    meta = _mapping(raw.get("metadata"))
    status = _mapping(raw.get("status"))
    generation = meta.get("generation")
    spec = raw.get("spec")
    return ObservedPool(
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "")),
        uid=str(meta.get("uid", "")),
        generation=generation if isinstance(generation, int) else None,
        deleting=meta.get("deletionTimestamp") is not None,
        spec=spec if isinstance(spec, Mapping) else None,
        conditions=parse_conditions(status.get("conditions")),
        status=status,
    )


def controller_uid(raw: Mapping[str, Any]) -> str | None:
    """The uid of the object's controlling owner, if any."""
    for ref in _mapping(raw.get("metadata")).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            uid = ref.get("uid")
            return uid if isinstance(uid, str) else None
    return None


# Quantities come back canonicalised ("0.5" -> "500m"): they are compared by the spec hash only.
_HASH_ONLY = frozenset({"resources"})


def covers(live: object, desired: object) -> bool:
    """Whether ``live`` still has every value ``desired`` sets (fields the API server or
    others added are ignored; lists must match element by element; a None in ``desired`` is a
    merge patch's deletion: the field must be absent)."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(
            key in _HASH_ONLY
            or (value is None and live.get(key) is None)
            or (key in live and covers(live[key], value))
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(covers(a, b) for a, b in zip(live, desired, strict=True))
        )
    return bool(live == desired)


def annotation(raw: Mapping[str, Any], key: str) -> str | None:
    value = _mapping(_mapping(raw.get("metadata")).get("annotations")).get(key)
    return value if isinstance(value, str) else None
