"""What every child object shares: owner reference, labels, security settings, the spec hash."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Final

from kvgate.operator.models import ResourceRequirements, TelemetrySpec
from kvgate.operator.naming import (
    ANNOTATION_SPEC_HASH,
    API_VERSION,
    APP_NAME,
    KIND,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_POOL,
    MANAGED_BY,
)

Manifest = dict[str, Any]  # a Kubernetes object, ready to be sent as JSON

# Every container runs as this unprivileged user; images must not need root.
RUN_AS_USER: Final = 10001


@dataclass(frozen=True)
class PoolRef:
    """The identity of one ExecutorPool object."""

    name: str
    namespace: str
    uid: str


def spec_hash(value: object) -> str:
    """A short, stable digest of a JSON-serialisable value (key order does not matter)."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def owner_reference(pool: PoolRef) -> Manifest:
    # controller + blockOwnerDeletion: the garbage collector deletes the child with the pool,
    # and a foreground deletion of the pool waits for it.
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": pool.name,
        "uid": pool.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def selector_labels(pool: PoolRef, component: str) -> dict[str, str]:
    """The labels that select one component of one pool (never change them: selectors)."""
    return {LABEL_POOL: pool.name, LABEL_COMPONENT: component}


def labels(pool: PoolRef, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: pool.name,
        LABEL_MANAGED_BY: MANAGED_BY,
        **selector_labels(pool, component),
    }


def object_meta(pool: PoolRef, name: str, component: str) -> Manifest:
    return {
        "name": name,
        "namespace": pool.namespace,
        "labels": labels(pool, component),
        "ownerReferences": [owner_reference(pool)],
    }


def with_spec_hash(manifest: Manifest) -> Manifest:
    """The manifest, annotated with the hash of itself (computed before the annotation)."""
    digest = spec_hash(manifest)
    meta = manifest["metadata"]
    meta["annotations"] = {**meta.get("annotations", {}), ANNOTATION_SPEC_HASH: digest}
    return manifest


def pod_security_context() -> Manifest:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> Manifest:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def resources(spec: ResourceRequirements, extra: dict[str, str] | None = None) -> Manifest:
    """Container resources: the user's requests and limits plus ``extra`` in both."""
    added = extra or {}
    built: Manifest = {}
    requests = {**{k: str(v) for k, v in spec.requests.items()}, **added}
    limits = {**{k: str(v) for k, v in spec.limits.items()}, **added}
    if requests:
        built["requests"] = requests
    if limits:
        built["limits"] = limits
    return built


def http_probe(path: str, port: str, *, period_s: int, failures: int) -> Manifest:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def secret_volume(name: str, secret_name: str, items: dict[str, str]) -> Manifest:
    """A Secret volume exposing ``items`` (key -> file name), readable by the pod's group."""
    return {
        "name": name,
        "secret": {
            "secretName": secret_name,
            "items": [{"key": key, "path": path} for key, path in items.items()],
            "defaultMode": 0o440,
        },
    }


def tmp_volume() -> Manifest:
    # The root filesystem is read-only; /tmp (and HOME, pointed at it) is the one writable
    # place, for library caches such as Triton's compiled kernels.
    return {"name": "tmp", "emptyDir": {}}


def telemetry_env(pool: PoolRef, telemetry: TelemetrySpec, component: str) -> list[Manifest]:
    """The OpenTelemetry variables of a pool's pod: its service name (``<serviceName>-<component>``)
    and resource attributes naming the pod, its namespace (Downward API) and the pool; then the
    pool's OTLP endpoint and protocol, when set. POD_NAME and POD_NAMESPACE come first: the
    kubelet expands ``$(VAR)`` only from variables defined earlier in the list."""
    env: list[Manifest] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "OTEL_SERVICE_NAME", "value": f"{telemetry.service_name}-{component}"},
        {
            "name": "OTEL_RESOURCE_ATTRIBUTES",
            "value": (
                "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),"
                f"kvgate.pool={pool.name}"
            ),
        },
    ]
    if telemetry.otlp_endpoint is not None:
        env.append({"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": telemetry.otlp_endpoint})
    if telemetry.otlp_protocol is not None:
        env.append({"name": "OTEL_EXPORTER_OTLP_PROTOCOL", "value": telemetry.otlp_protocol.value})
    return env
