"""Names the operator and its children share: the API group, labels, annotations, paths, ports.

Every child object of a pool is named after the pool, so the operator can find it again without
bookkeeping and two pools in one namespace never collide::

    <pool>-<slot>           executor Pod of slot 0..replicas-1 (stable name, like a StatefulSet)
    <pool>-executors        headless Service over the executor Pods
    <pool>-admission        admission Deployment, its ConfigMap and its Service (admin API)
    <pool>-admin-token      Secret holding the admin API bearer token (created by the operator)
"""

from __future__ import annotations

import re
from typing import Final

GROUP: Final = "kvgate.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "ExecutorPool"
PLURAL: Final = "executorpools"

# kopf's own bookkeeping (handler progress, last handled spec, finalizer) lives under this
# prefix, in our group, so that nothing of ours is written under kopf.zalando.org.
KOPF_PREFIX: Final = f"operator.{GROUP}"
KOPF_FINALIZER: Final = f"{KOPF_PREFIX}/finalizer"

LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_POOL: Final = f"{GROUP}/pool"
LABEL_SLOT: Final = f"{GROUP}/slot"
LABEL_REVISION: Final = f"{GROUP}/revision"

APP_NAME: Final = "kvgate"
MANAGED_BY: Final = "kvgate-operator"
COMPONENT_EXECUTOR: Final = "executor"
COMPONENT_ADMISSION: Final = "admission"

# The hash of the desired state of a child object: the operator patches a child only when it
# differs, so defaults the API server adds never cause a patch loop.
ANNOTATION_SPEC_HASH: Final = f"{GROUP}/spec-hash"
# On the admission pod template: a ConfigMap change rolls the admission pod.
ANNOTATION_CONFIG_HASH: Final = f"{GROUP}/config-hash"
# On an executor Pod: the model it was started for. The executor reads family and depth from the
# checkpoint itself (its command line has no flag for them); these make them visible on the pod,
# and a change of either is a change of the pod template, so executors are replaced.
ANNOTATION_MODEL_FAMILY: Final = f"{GROUP}/model-family"
ANNOTATION_MODEL_LOOPS: Final = f"{GROUP}/model-loops"
# On an executor Pod: when its drain started (RFC 3339). Set before the drain call, so an
# operator restart resumes the drain and measures its timeout from the original start.
ANNOTATION_DRAINING_SINCE: Final = f"{GROUP}/draining-since"

EXECUTOR_PORT: Final = 8000
ADMIN_PORT: Final = 8080
EXECUTOR_STEP_PATH: Final = "/v1/steps"

EXECUTOR_TOKEN_DIR: Final = "/var/run/kvgate/executor-token"
EXECUTOR_TOKEN_FILE: Final = f"{EXECUTOR_TOKEN_DIR}/token"
ADMIN_TOKEN_DIR: Final = "/var/run/kvgate/admin-token"
ADMIN_TOKEN_FILE: Final = f"{ADMIN_TOKEN_DIR}/token"
ADMIN_TOKEN_KEY: Final = "token"
CONFIG_DIR: Final = "/etc/kvgate"
CONFIG_KEY: Final = "admission.yaml"
CONFIG_FILE: Final = f"{CONFIG_DIR}/{CONFIG_KEY}"
KAFKA_SASL_DIR: Final = "/var/run/kvgate/kafka-sasl"
KAFKA_TLS_DIR: Final = "/var/run/kvgate/kafka-tls"
MODEL_DIR: Final = "/models"

# The longest child name is "<pool>-executors" (a Service: a DNS-1035 label, at most 63
# characters); a pod's hostname "<pool>-<slot>" must also stay a DNS label. 48 leaves room.
MAX_POOL_NAME_LENGTH: Final = 48
_POOL_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def pool_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a pool (its children's names derive from it), or None."""
    if len(name) > MAX_POOL_NAME_LENGTH:
        return (
            f"must be at most {MAX_POOL_NAME_LENGTH} characters (child Services and pod "
            f"hostnames are derived from it), got {len(name)}"
        )
    if not _POOL_NAME.match(name):
        return (
            "must start with a lower-case letter and contain only lower-case letters, digits "
            "and '-' (child Service names are DNS-1035 labels)"
        )
    return None


def executor_pod_name(pool: str, slot: int) -> str:
    return f"{pool}-{slot}"


def executor_service_name(pool: str) -> str:
    return f"{pool}-executors"


def admission_name(pool: str) -> str:
    """Name of the admission Deployment, its ConfigMap and its Service."""
    return f"{pool}-admission"


def admin_token_secret_name(pool: str) -> str:
    return f"{pool}-admin-token"


def step_endpoint(pod_ip: str) -> str:
    """The executor's step WebSocket URL the admission service connects to."""
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"ws://{host}:{EXECUTOR_PORT}{EXECUTOR_STEP_PATH}"
