"""Recorded step spans against a replay: the first step where the decisions differ.

The file is either the OpenTelemetry collector's file exporter output (OTLP JSON, one
``{"resourceSpans": [...]}`` object per line) or the service's own ``telemetry.spans_file``
(one span object per line, ``kvgate/telemetry/spans_file.py``). The admission service's step
span (``kvgate.step.round_trip``) carries the decisions by request id
(``kvgate.step.{admitted,prefill,decode,preempted}_ids``); the executor's ``kvgate.step`` span,
its child, carries only counts and is not compared. With several executors, ``executor`` picks
one (``kvgate.executor.id``); the file must then hold only that executor's steps or name it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.admission_service.tracing import StepDecisions
from kvgate.telemetry import attributes as attr

_DECISION_KEYS = (
    ("admitted", attr.STEP_ADMITTED_IDS),
    ("prefilled", attr.STEP_PREFILL_IDS),
    ("decoded", attr.STEP_DECODE_IDS),
    ("preempted", attr.STEP_PREEMPTED_IDS),
)


class SpansFileError(ValueError):
    """A spans file that cannot be compared, with the line that says why."""


@dataclass(frozen=True, slots=True)
class RecordedStep:
    step_id: int
    executor: str | None
    decisions: StepDecisions


def load_recorded_steps(path: Path, *, executor: str | None = None) -> list[RecordedStep]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpansFileError(f"cannot read spans file {path}: {exc}") from None
    steps: list[RecordedStep] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpansFileError(f"{path}:{number}: not JSON: {exc.msg}") from None
        for name, attributes in _spans_of(item, f"{path}:{number}"):
            if name == attr.ADMISSION_STEP_SPAN:
                steps.append(_recorded(attributes, f"{path}:{number}"))
    executors = {s.executor for s in steps}
    if executor is not None:
        steps = [s for s in steps if s.executor == executor]
    elif len(executors) > 1:
        raise SpansFileError(
            f"{path} holds steps of several executors ({sorted(map(str, executors))}); "
            "name one with --spans-executor"
        )
    steps.sort(key=lambda s: s.step_id)
    return steps


def _spans_of(item: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    if not isinstance(item, dict):
        raise SpansFileError(f"{where}: a span line must be a JSON object")
    if "resourceSpans" in item:  # OTLP JSON
        out = []
        for resource in item.get("resourceSpans") or []:
            for scope in resource.get("scopeSpans") or []:
                for span in scope.get("spans") or []:
                    attributes = {
                        a["key"]: _otlp_value(a.get("value") or {})
                        for a in span.get("attributes") or []
                    }
                    out.append((str(span.get("name")), attributes))
        return out
    if "name" in item and isinstance(item.get("attributes"), dict):
        return [(str(item["name"]), item["attributes"])]
    raise SpansFileError(f"{where}: neither an OTLP JSON export nor a kvgate span line")


def _otlp_value(value: dict[str, Any]) -> Any:
    """An OTLP JSON ``AnyValue``; 64-bit integers arrive as strings (proto3 JSON mapping)."""
    if "arrayValue" in value:
        return [_otlp_value(v) for v in (value["arrayValue"].get("values") or [])]
    if "intValue" in value:
        return int(value["intValue"])
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in value:
            return value[key]
    return None


def _recorded(attributes: dict[str, Any], where: str) -> RecordedStep:
    step_id = attributes.get(attr.STEP_ID)
    if not isinstance(step_id, int):
        raise SpansFileError(f"{where}: a {attr.ADMISSION_STEP_SPAN} span without {attr.STEP_ID}")
    fields: dict[str, tuple[str, ...]] = {}
    for name, key in _DECISION_KEYS:
        ids = attributes.get(key)
        if not isinstance(ids, list):
            raise SpansFileError(
                f"{where}: step {step_id} has no {key} (spans from a service that did not "
                "record its decisions)"
            )
        fields[name] = tuple(str(i) for i in ids)
    executor = attributes.get(attr.EXECUTOR_ID)
    return RecordedStep(
        step_id, None if executor is None else str(executor), StepDecisions(**fields)
    )


@dataclass(frozen=True, slots=True)
class Divergence:
    index: int  # position in plan order (0 = the first planned step)
    step_id: int | None
    field: str  # admitted | prefilled | decoded | preempted | missing | extra
    expected: list[str] | None  # recorded
    got: list[str] | None  # replayed

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "step_id": self.step_id,
            "field": self.field,
            "expected": self.expected,
            "got": self.got,
        }


def first_divergence(
    recorded: list[RecordedStep], replayed: list[tuple[int, StepDecisions]]
) -> Divergence | None:
    """Steps are compared in plan order, each field as a list (plan order matters: it is the
    order rows run in)."""
    for index in range(max(len(recorded), len(replayed))):
        if index >= len(recorded):
            step_id, got = replayed[index]
            return Divergence(index, step_id, "extra", None, _summary(got))
        if index >= len(replayed):
            want = recorded[index]
            return Divergence(index, want.step_id, "missing", _summary(want.decisions), None)
        want, (_, got) = recorded[index], replayed[index]
        for name, _key in _DECISION_KEYS:
            expected, actual = getattr(want.decisions, name), getattr(got, name)
            if expected != actual:
                return Divergence(index, want.step_id, name, list(expected), list(actual))
    return None


def _summary(decisions: StepDecisions) -> list[str]:
    return [f"{name}={list(getattr(decisions, name))}" for name, _ in _DECISION_KEYS]
