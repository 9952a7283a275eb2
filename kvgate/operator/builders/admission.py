"""The pool's admission service: its config file, ConfigMap, Deployment, Service and admin token.

The admission service reads one YAML file (``--config``). Secrets never enter that file: the
SASL password, TLS material and both bearer tokens are mounted from Secrets and referenced by
path. Membership is not in the file either; the operator pushes it through the admin API.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import yaml

from kvgate.operator.builders.common import (
    Manifest,
    PoolRef,
    container_security_context,
    http_probe,
    labels,
    object_meta,
    pod_security_context,
    resources,
    secret_volume,
    selector_labels,
    spec_hash,
    telemetry_env,
    tmp_volume,
)
from kvgate.operator.models import ExecutorPoolSpec, KafkaSpec
from kvgate.operator.naming import (
    ADMIN_PORT,
    ADMIN_TOKEN_DIR,
    ADMIN_TOKEN_FILE,
    ADMIN_TOKEN_KEY,
    ANNOTATION_CONFIG_HASH,
    COMPONENT_ADMISSION,
    CONFIG_DIR,
    CONFIG_FILE,
    CONFIG_KEY,
    EXECUTOR_TOKEN_DIR,
    EXECUTOR_TOKEN_FILE,
    KAFKA_SASL_DIR,
    KAFKA_TLS_DIR,
    admin_token_secret_name,
    admission_name,
)

CONTAINER = "admission"
_TLS_FILES = {"ca": "ca.crt", "certificate": "tls.crt", "private_key": "tls.key"}


def _kafka_config(pool: PoolRef, kafka: KafkaSpec) -> dict[str, Any]:
    topics = kafka.topics
    config: dict[str, Any] = {
        "bootstrap_servers": kafka.bootstrap_servers,
        "request_topic": topics.requests,
        "result_topic": topics.results,
        "abort_topic": topics.aborts,
        "dlq_topic": topics.dead_letter,
        # Kafka group ids are cluster-wide: the namespace keeps equally named pools apart.
        "group_id": kafka.group_id or f"kvgate-{pool.namespace}-{pool.name}",
        "security_protocol": kafka.security.protocol.value,
        # Always written: the service's own default differs, and the pool's choice must hold.
        "create_topics": kafka.create_topics,
    }
    if topics.tokens is not None:
        config["token_topic"] = topics.tokens
    if kafka.token_records is not None:  # only when set: other pools' files stay as they were
        config["token_records"] = kafka.token_records.value
    sasl = kafka.security.sasl
    if sasl is not None:
        config["sasl_mechanism"] = sasl.mechanism.value
        config["sasl_username"] = sasl.username
        config["sasl_password_file"] = f"{KAFKA_SASL_DIR}/password"
    tls = kafka.security.tls
    if tls is not None:
        if tls.ca is not None:
            config["ssl_cafile"] = f"{KAFKA_TLS_DIR}/{_TLS_FILES['ca']}"
        if tls.certificate is not None:
            config["ssl_certfile"] = f"{KAFKA_TLS_DIR}/{_TLS_FILES['certificate']}"
            config["ssl_keyfile"] = f"{KAFKA_TLS_DIR}/{_TLS_FILES['private_key']}"
    return config


# On SIGTERM the service gives running work GRACE_PERIOD_S, then hands off, commits and closes
# within CLOSING_TIMEOUT_S; the kubelet must not kill it before (the rest is process exit).
GRACE_PERIOD_S = 30
CLOSING_TIMEOUT_S = 20
TERMINATION_GRACE_S = GRACE_PERIOD_S + CLOSING_TIMEOUT_S + 10


def build_admission_config(pool: PoolRef, spec: ExecutorPoolSpec) -> dict[str, Any]:
    """The admission service's config file, as data (see ``render_admission_config``)."""
    telemetry: dict[str, Any] = {
        "service_name": f"{spec.telemetry.service_name}-admission",
        "model_name": spec.model.container_path,
    }
    if spec.telemetry.otlp_endpoint is not None:
        telemetry["otlp_endpoint"] = spec.telemetry.otlp_endpoint
    config: dict[str, Any] = {
        "kafka": _kafka_config(pool, spec.kafka),
        # Only what the pool sets: the service applies its own defaults to the rest.
        "scheduler": spec.scheduler.model_dump(mode="json", exclude_unset=True),
        "admin": {"host": "0.0.0.0", "port": ADMIN_PORT, "token_file": ADMIN_TOKEN_FILE},
        # Text requests: the service takes the tokenizer the executors serve (GET /v1/tokenizer),
        # since only they can read the model. telemetry.model_name names the model, so a new
        # model changes the file's hash and restarts the service with no pool tokenizer yet.
        "executors": {"token_file": EXECUTOR_TOKEN_FILE, "tokenizer_from_executors": True},
        "telemetry": telemetry,
        "shutdown": {"grace_period_s": GRACE_PERIOD_S, "closing_timeout_s": CLOSING_TIMEOUT_S},
    }
    if "tenants" in spec.model_fields_set:
        # Written only when set: a pool without quotas keeps its file (and its hash) unchanged.
        config["tenants"] = spec.tenants.model_dump(mode="json", exclude_unset=True)
    return config


def render_admission_config(pool: PoolRef, spec: ExecutorPoolSpec) -> str:
    return yaml.safe_dump(build_admission_config(pool, spec), sort_keys=False)


def build_admission_configmap(pool: PoolRef, spec: ExecutorPoolSpec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(pool, admission_name(pool.name), COMPONENT_ADMISSION),
        "data": {CONFIG_KEY: render_admission_config(pool, spec)},
    }


def build_admin_token_secret(pool: PoolRef, token: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": object_meta(pool, admin_token_secret_name(pool.name), COMPONENT_ADMISSION),
        "data": {ADMIN_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def _volumes(pool: PoolRef, spec: ExecutorPoolSpec) -> tuple[list[Manifest], list[Manifest]]:
    volumes: list[Manifest] = [
        {"name": "config", "configMap": {"name": admission_name(pool.name)}},
        secret_volume(
            "admin-token", admin_token_secret_name(pool.name), {ADMIN_TOKEN_KEY: "token"}
        ),
        secret_volume("executor-token", spec.token_secret.name, {spec.token_secret.key: "token"}),
        tmp_volume(),
    ]
    mounts: list[Manifest] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
        {"name": "executor-token", "mountPath": EXECUTOR_TOKEN_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    security = spec.kafka.security
    if security.sasl is not None:
        ref = security.sasl.password_secret
        volumes.append(secret_volume("kafka-sasl", ref.name, {ref.key: "password"}))
        mounts.append({"name": "kafka-sasl", "mountPath": KAFKA_SASL_DIR, "readOnly": True})
    if security.tls is not None:
        tls = security.tls
        keys = {"ca": tls.ca, "certificate": tls.certificate, "private_key": tls.private_key}
        items = {key: _TLS_FILES[field] for field, key in keys.items() if key is not None}
        volumes.append(secret_volume("kafka-tls", tls.secret_name, items))
        mounts.append({"name": "kafka-tls", "mountPath": KAFKA_TLS_DIR, "readOnly": True})
    return volumes, mounts


def config_hash(pool: PoolRef, spec: ExecutorPoolSpec, admin_token: str) -> str:
    """Changes when the config file or the admin token changes: the admission pod then
    restarts (a new pod-template annotation), so it never runs with stale settings."""
    token_digest = hashlib.sha256(admin_token.encode()).hexdigest()
    return spec_hash({"config": render_admission_config(pool, spec), "token": token_digest})


def _strategy(replicas: int) -> Manifest:
    """One replica: the old pod stops before the new starts (the membership goes through the
    Service, so two pods would take the executors from each other). Several: one pod at a
    time is added before one goes; the operator moves executors between them (``shards.py``).
    The ``None`` deletes the other type's settings in the merge patch."""
    if replicas <= 1:
        return {"type": "Recreate", "rollingUpdate": None}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def build_admission_deployment(
    pool: PoolRef, spec: ExecutorPoolSpec, *, image: str, admin_token: str
) -> Manifest:
    volumes, mounts = _volumes(pool, spec)
    admission = spec.admission
    env: list[Manifest] = [
        *telemetry_env(pool, spec.telemetry, COMPONENT_ADMISSION),
        {"name": "HOME", "value": "/tmp"},
    ]
    container: Manifest = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": (admission.image_pull_policy or spec.image_pull_policy).value,
        "command": ["kvgate"],
        "args": ["admission-service", "--config", CONFIG_FILE],
        "ports": [{"name": "admin", "containerPort": ADMIN_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": resources(admission.resources),
        "livenessProbe": http_probe("/healthz", "admin", period_s=10, failures=3),
        "readinessProbe": http_probe("/readyz", "admin", period_s=5, failures=3),
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }
    pod_spec: Manifest = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "containers": [container],
        "volumes": volumes,
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": ref.name} for ref in spec.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(pool, admission_name(pool.name), COMPONENT_ADMISSION),
        "spec": {
            "replicas": admission.replicas,
            "strategy": _strategy(admission.replicas),
            "selector": {"matchLabels": selector_labels(pool, COMPONENT_ADMISSION)},
            "template": {
                "metadata": {
                    "labels": labels(pool, COMPONENT_ADMISSION),
                    "annotations": {ANNOTATION_CONFIG_HASH: config_hash(pool, spec, admin_token)},
                },
                "spec": pod_spec,
            },
        },
    }


def build_admission_service(pool: PoolRef) -> Manifest:
    """The admin API (and metrics) of the pool's admission service; the operator calls it."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(pool, admission_name(pool.name), COMPONENT_ADMISSION),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(pool, COMPONENT_ADMISSION),
            "ports": [
                {"name": "admin", "port": ADMIN_PORT, "targetPort": "admin", "protocol": "TCP"}
            ],
        },
    }
