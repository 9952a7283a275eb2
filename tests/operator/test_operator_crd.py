"""The CRD (charts/kvgate/crds/executorpools.kvgate.dev.yaml, the one copy) against examples and
against the Python models it must agree with.

Kubernetes' openAPIV3Schema is OpenAPI 3.0, whose numeric keywords follow JSON Schema draft 4
(``exclusiveMinimum: true`` modifies ``minimum``): examples are checked with Draft4Validator.
"""

from __future__ import annotations

import copy
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any

import annotated_types
import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kvgate.operator.models import ExecutorPoolSpec, parse_spec
from kvgate.operator.naming import GROUP, KIND, PLURAL, VERSION
from kvgate.operator.status import ConditionType, Phase
from kvgate.protocol.enums import DType, ExitPolicy, ModelFamily, PackagedModel
from kvgate.protocol.enums import ExitPolicy as ExecutorExitPolicy
from kvgate.scheduler.config import (
    AdmissionPricing,
    CacheConfig,
    Mode,
    Policy,
    PreemptionMode,
    SchedulerConfig,
)
from tests.operator.cluster import pool_manifest
from tests.operator.examples import FULL_SPEC


def _version(crd: dict[str, Any]) -> dict[str, Any]:
    [version] = crd["spec"]["versions"]
    return dict(version)


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    return dict(_version(crd)["schema"]["openAPIV3Schema"])


def _spec_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return dict(_schema(crd)["properties"]["spec"])


def _errors(crd: dict[str, Any], resource: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(_schema(crd))
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(resource)
    ]


def test_the_crd_is_a_valid_apiextensions_object(crd: dict[str, Any]) -> None:
    assert kubernetes_validate.validate(crd, "1.31", strict=True)
    assert crd["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    assert crd["spec"]["names"]["kind"] == KIND
    assert _version(crd)["name"] == VERSION


def test_status_and_scale_subresources(crd: dict[str, Any]) -> None:
    subresources = _version(crd)["subresources"]
    assert subresources["status"] == {}
    assert subresources["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def test_printer_columns_point_at_declared_fields(crd: dict[str, Any]) -> None:
    schema = _schema(crd)
    for column in _version(crd)["additionalPrinterColumns"]:
        path = column["jsonPath"].lstrip(".").split(".")
        if path[0] == "metadata":
            continue
        node = schema
        for part in path:
            node = node["properties"][part]
        assert node["type"] == {"date": "string"}.get(column["type"], column["type"]), column


@pytest.mark.parametrize(
    "spec",
    [
        pool_manifest()["spec"],
        FULL_SPEC,
        {**pool_manifest()["spec"], "replicas": 0},
        {**pool_manifest()["spec"], "model": {"family": "llama", "path": "/m"}},
        {
            **pool_manifest()["spec"],
            "model": {"family": "looped", "volume": {"hostPath": {"path": "/data/ouro"}}},
        },
        {
            **pool_manifest()["spec"],
            "model": {"family": "llama", "packaged": "SmolLM2-135M-Instruct"},
        },
        {
            **pool_manifest()["spec"],
            "model": {
                "family": "llama",
                "volume": {"persistentVolumeClaim": {"claimName": "m"}, "subPath": "s/smol.gguf"},
            },
        },
    ],
    ids=[
        "minimal",
        "full",
        "zero-replicas",
        "llama-in-image",
        "hostpath-volume",
        "packaged",
        "gguf-on-volume",
    ],
)
def test_valid_examples_pass_the_schema_and_the_operator(
    crd: dict[str, Any], spec: dict[str, Any]
) -> None:
    resource = {**pool_manifest(), "spec": spec}
    assert _errors(crd, resource) == []
    parse_spec("pool", spec)  # and the operator accepts them as well


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("no image", {"image": None}, "'image' is a required property"),
    ("replicas too big", {"replicas": 1025}, "1025 is greater than the maximum of 1024"),
    ("replicas negative", {"replicas": -1}, "-1 is less than the minimum of 0"),
    ("replicas as text", {"replicas": "2"}, "'2' is not of type 'integer'"),
    ("gpus zero", {"gpusPerExecutor": 0}, "0 is less than the minimum of 1"),
    ("pull policy", {"imagePullPolicy": "Sometimes"}, "'Sometimes' is not one of"),
    ("family", {"model": {"family": "gpt", "path": "/m"}}, "'gpt' is not one of"),
    ("dtype", {"model": {"family": "llama", "path": "/m", "dtype": "int8"}}, "'int8' is not one"),
    ("loops", {"model": {"family": "looped", "path": "/m", "loops": 65}}, "greater than the max"),
    ("no source", {"model": {"family": "llama"}}, "is not valid under any of the given schemas"),
    (
        "two sources",
        {"model": {"family": "llama", "path": "/m", "volume": {"hostPath": {"path": "/x"}}}},
        "is valid under each of",
    ),
    ("relative path", {"model": {"family": "llama", "path": "m"}}, "does not match '^/'"),
    ("packaged name", {"model": {"family": "llama", "packaged": "gpt-2"}}, "'gpt-2' is not one of"),
    (
        "packaged and path",
        {"model": {"family": "llama", "path": "/m", "packaged": "SmolLM2-135M-Instruct"}},
        "is valid under each of",
    ),
    ("quantity", {"resources": {"limits": {"memory": "lots"}}}, "does not match"),
    ("cache both", {"kvCache": {"numBlocks": 10, "memoryFraction": 0.5}}, "should not be valid"),
    ("fraction zero", {"kvCache": {"memoryFraction": 0}}, "less than or equal to the minimum"),
    ("policy", {"scheduler": {"policy": "lottery"}}, "'lottery' is not one of"),
    ("preemption", {"scheduler": {"preemption": "sometimes"}}, "'sometimes' is not one of"),
    ("mode", {"scheduler": {"mode": "batch"}}, "'batch' is not one of"),
    ("max seqs", {"scheduler": {"maxNumSeqs": 65537}}, "greater than the maximum of 65536"),
    ("watermark", {"scheduler": {"watermarkRatio": 1.0}}, "greater than or equal to the maximum"),
    ("bypasses", {"scheduler": {"maxAdmissionBypasses": -1}}, "less than the minimum of 0"),
    ("bootstrap", {"kafka": {"bootstrapServers": "a:1, b:2"}}, "does not match"),
    ("protocol", {"kafka": {"bootstrapServers": "k:1", "security": {"protocol": "TLS"}}}, "'TLS'"),
    ("topic", {"kafka": {"bootstrapServers": "k:1", "topics": {"requests": "a b"}}}, "match"),
    ("create topics", {"kafka": {"bootstrapServers": "k:1", "createTopics": "yes"}}, "'yes'"),
    ("token secret", {"tokenSecret": {"key": "token"}}, "'name' is a required property"),
    ("admission replicas", {"admission": {"replicas": 65}}, "greater than the maximum of 64"),
    ("quota zero", {"tenants": {"quotas": {"a": {"tokensPerMinute": 0}}}}, "less than the min"),
    ("quota no rate", {"tenants": {"defaultQuota": {"burstTokens": 5}}}, "'tokensPerMinute'"),
    ("drain timeout", {"drainTimeoutSeconds": 0}, "less than the minimum of 1"),
    ("otlp", {"telemetry": {"otlpEndpoint": "collector:4318"}}, "does not match"),
    ("otlp-protocol", {"telemetry": {"otlpProtocol": "http/json"}}, "is not one of"),
]


@pytest.mark.parametrize(
    ("change", "message"), [(c, m) for _, c, m in INVALID], ids=[i for i, _, _ in INVALID]
)
def test_invalid_examples_fail_the_schema(
    crd: dict[str, Any], change: dict[str, Any], message: str
) -> None:
    spec = copy.deepcopy(pool_manifest()["spec"])
    for key, value in change.items():
        if value is None:
            del spec[key]
        else:
            spec[key] = value
    errors = _errors(crd, {**pool_manifest(), "spec": spec})
    assert any(message in error for error in errors), errors


def test_status_written_by_the_operator_fits_the_schema(crd: dict[str, Any]) -> None:
    status = {
        "phase": "Progressing",
        "observedGeneration": 3,
        "replicas": 2,
        "readyReplicas": 1,
        "updatedReplicas": 1,
        "revision": "0123456789abcdef",
        "selector": "app.kubernetes.io/component=executor,kvgate.dev/pool=pool",
        "executors": [
            {
                "name": "pool-0",
                "slot": 0,
                "revision": "0123456789abcdef",
                "ready": True,
                "draining": False,
                "endpoint": "ws://10.0.0.1:8000/v1/steps",
            },
        ],
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": "RollingUpdate",
                "message": "1/2",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
                "observedGeneration": 3,
            },
        ],
    }
    assert _errors(crd, {**pool_manifest(), "status": status}) == []
    schema = _schema(crd)["properties"]["status"]["properties"]
    assert set(schema["phase"]["enum"]) == {p.value for p in Phase}
    assert set(schema["conditions"]["items"]["properties"]["type"]["enum"]) == {
        c.value for c in ConditionType
    }


# --- the CRD and the Python models agree ---------------------------------------------------------


def test_enums_mirror_the_python_settings(crd: dict[str, Any]) -> None:
    spec = _spec_schema(crd)["properties"]
    scheduler = spec["scheduler"]["properties"]
    assert scheduler["policy"]["enum"] == [p.value for p in Policy]
    assert scheduler["mode"]["enum"] == [m.value for m in Mode]
    assert scheduler["preemption"]["enum"] == [m.value for m in PreemptionMode]
    assert scheduler["admissionPricing"]["enum"] == [p.value for p in AdmissionPricing]
    assert spec["model"]["properties"]["family"]["enum"] == [f.value for f in ModelFamily]
    assert spec["model"]["properties"]["dtype"]["enum"] == [d.value for d in DType]
    assert spec["model"]["properties"]["packaged"]["enum"] == [m.value for m in PackagedModel]
    exit_policies = [e.value for e in ExitPolicy]
    assert spec["model"]["properties"]["exitPolicy"]["enum"] == exit_policies
    assert exit_policies == [e.value for e in ExecutorExitPolicy]  # what the executor accepts


def test_cache_ranges_mirror_cache_config(crd: dict[str, Any]) -> None:
    kv_cache = _spec_schema(crd)["properties"]["kvCache"]["properties"]
    for crd_name, field in [
        ("numBlocks", "num_blocks"),
        ("hostSnapshotBlocks", "host_snapshot_blocks"),
    ]:
        assert _bounds(kv_cache[crd_name]) == _model_bounds(CacheConfig.model_fields[field]), (
            crd_name
        )


def _bounds(schema: dict[str, Any]) -> dict[str, Any]:
    bounds: dict[str, Any] = {}
    if "minimum" in schema:
        bounds["gt" if schema.get("exclusiveMinimum") else "ge"] = schema["minimum"]
    if "maximum" in schema:
        bounds["lt" if schema.get("exclusiveMaximum") else "le"] = schema["maximum"]
    for key in ("minLength", "maxLength", "pattern"):
        if key in schema:
            bounds[key] = schema[key]
    return bounds


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """(the type without None and Annotated, the constraints found on the way)."""
    metadata: list[Any] = []
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation, *extra = typing.get_args(annotation)
            for item in extra:
                metadata.extend(item.metadata if isinstance(item, FieldInfo) else [item])
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation, metadata
            annotation = args[0]
        else:
            return annotation, metadata


def _model_bounds(field: FieldInfo) -> dict[str, Any]:
    _, metadata = _unwrap(field.annotation)
    bounds: dict[str, Any] = {}
    for item in [*field.metadata, *metadata]:
        if isinstance(
            item, annotated_types.Ge | annotated_types.Gt | annotated_types.Le | annotated_types.Lt
        ):
            name = type(item).__name__.lower()
            bounds[name] = getattr(item, name)
        elif isinstance(item, annotated_types.MinLen):
            bounds["minLength"] = item.min_length
        elif isinstance(item, annotated_types.MaxLen):
            bounds["maxLength"] = item.max_length
        elif getattr(item, "pattern", None) is not None:
            bounds["pattern"] = item.pattern
    return bounds


_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}


def _compare(model: type[BaseModel], schema: dict[str, Any], path: str) -> list[str]:
    """Differences between a model's fields and a CRD object schema, recursively."""
    problems = []
    properties = schema.get("properties", {})
    names = {to_camel(n): n for n in model.model_fields}
    for extra in sorted(set(properties) - set(names)):
        problems.append(f"{path}.{extra}: in the CRD, not in {model.__name__}")
    for crd_name, field_name in sorted(names.items()):
        where = f"{path}.{crd_name}"
        if crd_name not in properties:
            problems.append(f"{where}: in {model.__name__}, not in the CRD")
            continue
        field = model.model_fields[field_name]
        node = properties[crd_name]
        kind, _ = _unwrap(field.annotation)
        origin = typing.get_origin(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            problems += _compare(kind, node, where)
            if node.get("type") != "object":
                problems.append(f"{where}: not an object in the CRD")
        elif origin is list:
            (item,) = typing.get_args(kind)
            item_type, _ = _unwrap(item)
            if node.get("type") != "array":
                problems.append(f"{where}: not an array in the CRD")
            elif isinstance(item_type, type) and issubclass(item_type, BaseModel):
                problems += _compare(item_type, node["items"], f"{where}[]")
        elif origin is dict:
            if node.get("type") != "object":
                problems.append(f"{where}: not an object in the CRD")
            value_type, _ = _unwrap(typing.get_args(kind)[1])
            if isinstance(value_type, type) and issubclass(value_type, BaseModel):
                values = node.get("additionalProperties", {})
                problems += _compare(value_type, values, f"{where}{{}}")
        elif isinstance(kind, type) and issubclass(kind, Enum):
            if node.get("enum") != [member.value for member in kind]:
                problems.append(f"{where}: enum {node.get('enum')} != {[m.value for m in kind]}")
        elif kind in _TYPES:
            if node.get("type") != _TYPES[kind]:
                problems.append(f"{where}: type {node.get('type')} != {_TYPES[kind]}")
            if _bounds(node) != _model_bounds(field):
                problems.append(f"{where}: bounds {_bounds(node)} != {_model_bounds(field)}")
        default = field.default
        has_default = default is not PydanticUndefined and default is not None
        if has_default and not isinstance(default, BaseModel | list | dict):
            value = default.value if isinstance(default, Enum) else default
            if "default" in node and node["default"] != value:
                problems.append(f"{where}: default {node['default']!r} != {value!r}")
    return problems


def test_the_schema_and_the_spec_model_agree(crd: dict[str, Any]) -> None:
    """Every field, type, enum, range and default of the models is the CRD's, and vice versa."""
    assert _compare(ExecutorPoolSpec, _spec_schema(crd), "spec") == []


def test_scheduler_settings_mirror_scheduler_config(crd: dict[str, Any]) -> None:
    scheduler = _spec_schema(crd)["properties"]["scheduler"]
    assert _compare(SchedulerConfig, scheduler, "spec.scheduler") == []
    # No defaults in the CRD: unset settings are left to the admission service.
    assert not any("default" in node for node in scheduler["properties"].values())


def test_the_agreement_check_notices_drift(crd: dict[str, Any]) -> None:
    """The comparison above fails when the CRD and a model differ (it can fail)."""
    drifted = copy.deepcopy(_spec_schema(crd))
    drifted["properties"]["scheduler"]["properties"]["maxNumSeqs"]["maximum"] = 4096
    drifted["properties"]["model"]["properties"]["dtype"]["enum"].remove("bfloat16")
    del drifted["properties"]["drainTimeoutSeconds"]
    problems = _compare(ExecutorPoolSpec, drifted, "spec")
    assert any("maxNumSeqs: bounds" in p for p in problems)
    assert any("dtype: enum" in p for p in problems)
    assert any("drainTimeoutSeconds: in ExecutorPoolSpec, not in the CRD" in p for p in problems)


def test_the_documented_example_is_valid(crd: dict[str, Any]) -> None:
    docs = Path(__file__).parents[2] / "docs" / "operator.md"
    example = yaml.safe_load(docs.read_text().split("```yaml\n", 1)[1].split("```", 1)[0])
    assert example["kind"] == "ExecutorPool"
    assert _errors(crd, example) == []
    parse_spec(example["metadata"]["name"], example["spec"])
