"""The parts of values.schema.json that come from the ExecutorPool CRD, derived mechanically.

The chart's `kafka` values and `examplePool.spec` are an ExecutorPool's `spec.kafka` and spec, so
their schema is the CRD's (the one source of truth), translated from the CRD's OpenAPI 3.0
dialect to the JSON Schema draft 7 that helm checks values with:

- `minimum` with `exclusiveMinimum: true` (draft 4) becomes `exclusiveMinimum: <number>`; the
  same for maximum;
- `x-kubernetes-*` and `format` annotations are dropped; `nullable: true` makes `null` one more
  type;
- an object with declared properties (our own objects) gets `additionalProperties: false`,
  which the API server expresses by pruning unknown fields instead; objects that preserve
  unknown fields (affinity) or are maps (nodeSelector, resources) stay open.

The chart then differs from the CRD in three documented ways: `image` and `kafka` are not part of
`examplePool.spec` (they come from `images.executor` and `kafka`), `kafka.bootstrapServers` may be
empty (it is required only with `examplePool.enabled`, a rule at the root of the schema), and
`kafka.security` states the protocol rules the operator checks (SASL settings exactly with a
SASL protocol, TLS settings only with an SSL protocol), so helm refuses them before install.
`gateway.kafkaSecurity` (the gateway's own Kafka security) is `kafka.security`'s schema again.

``python -m tests.chart.values_schema`` rewrites those parts of values.schema.json;
``tests/chart/test_chart_schema.py`` fails when the file differs from what this module derives.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).parents[2] / "charts" / "kvgate"
CRD_PATH = CHART / "crds" / "executorpools.kvgate.dev.yaml"
VALUES_SCHEMA_PATH = CHART / "values.schema.json"

Schema = dict[str, Any]

_DROPPED = ("format", "exclusiveMinimum", "exclusiveMaximum")
_SASL_PROTOCOLS = ["SASL_PLAINTEXT", "SASL_SSL"]
_TLS_PROTOCOLS = ["SSL", "SASL_SSL"]


def load_crd() -> Schema:
    return dict(yaml.safe_load(CRD_PATH.read_text()))


def crd_spec_schema(crd: Schema) -> Schema:
    [version] = crd["spec"]["versions"]
    return dict(version["schema"]["openAPIV3Schema"]["properties"]["spec"])


def to_draft7(node: Schema) -> Schema:
    """One CRD schema node in draft-7 terms (see the module docstring)."""
    out: Schema = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in _DROPPED:
            continue
        if key == "minimum" and node.get("exclusiveMinimum") is True:
            out["exclusiveMinimum"] = value
        elif key == "maximum" and node.get("exclusiveMaximum") is True:
            out["exclusiveMaximum"] = value
        elif key == "properties":
            out[key] = {name: to_draft7(child) for name, child in value.items()}
        elif key in ("items", "not", "additionalProperties") and isinstance(value, dict):
            out[key] = to_draft7(value)
        elif key in ("oneOf", "anyOf", "allOf"):
            out[key] = [to_draft7(child) for child in value]
        else:
            out[key] = copy.deepcopy(value)
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]  # OpenAPI's nullable: null is one more type
    closed = "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields")
    if node.get("type") == "object" and closed and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


def kafka_schema(crd: Schema) -> Schema:
    kafka = to_draft7(crd_spec_schema(crd)["properties"]["kafka"])
    kafka["description"] = (
        "Kafka for the example pool: the ExecutorPool's spec.kafka. bootstrapServers may be "
        "empty unless examplePool.enabled."
    )
    kafka.pop("required", None)
    servers = kafka["properties"]["bootstrapServers"]
    servers["pattern"] = "^$|" + servers["pattern"]
    security = kafka["properties"]["security"]
    security["allOf"] = [
        {
            "description": "SASL settings exactly with a SASL protocol.",
            "if": {
                "required": ["protocol"],
                "properties": {"protocol": {"enum": _SASL_PROTOCOLS}},
            },
            "then": {"required": ["sasl"]},
            "else": {"properties": {"sasl": False}},
        },
        {
            "description": "TLS settings only with an SSL protocol.",
            "if": {
                "not": {
                    "required": ["protocol"],
                    "properties": {"protocol": {"enum": _TLS_PROTOCOLS}},
                }
            },
            "then": {"properties": {"tls": False}},
        },
    ]
    return kafka


def example_spec_schema(crd: Schema) -> Schema:
    spec = to_draft7(crd_spec_schema(crd))
    spec["description"] = (
        "An ExecutorPool spec without image (from images.executor) and kafka (from kafka)."
    )
    for name in ("image", "kafka"):
        del spec["properties"][name]
    spec["required"] = [name for name in spec["required"] if name not in ("image", "kafka")]
    return spec


def gateway_kafka_security_schema(crd: Schema) -> Schema:
    security = copy.deepcopy(kafka_schema(crd)["properties"]["security"])
    security["description"] = (
        "The gateway's own Kafka security, in the shape of kafka.security; empty means "
        "kafka.security."
    )
    return security


def derived_values_schema(current: Schema, crd: Schema) -> Schema:
    """``current`` (the chart's values schema) with the CRD-derived parts put in place."""
    schema = copy.deepcopy(current)
    schema["properties"]["kafka"] = kafka_schema(crd)
    schema["properties"]["gateway"]["properties"]["kafkaSecurity"] = gateway_kafka_security_schema(
        crd
    )
    schema["properties"]["examplePool"]["properties"]["spec"] = example_spec_schema(crd)
    return schema


def render(schema: Schema) -> str:
    return json.dumps(schema, indent=2) + "\n"


def main() -> None:
    current = json.loads(VALUES_SCHEMA_PATH.read_text())
    VALUES_SCHEMA_PATH.write_text(render(derived_values_schema(current, load_crd())))
    print(f"wrote {VALUES_SCHEMA_PATH}")


if __name__ == "__main__":
    main()
