"""Executor Pods and their headless Service.

A pod is the pool's template plus its slot. The template's hash is the pool's *revision*: a pod
whose revision label differs from it is outdated and gets replaced (drained first). Pods are
immutable in the ways that matter here (image, args, resources), hence replacement.
"""

from __future__ import annotations

import copy
from typing import Any

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
from kvgate.operator.models import GPU_RESOURCE, ExecutorPoolSpec, ModelSpec
from kvgate.operator.naming import (
    ANNOTATION_MODEL_FAMILY,
    ANNOTATION_MODEL_LOOPS,
    COMPONENT_EXECUTOR,
    EXECUTOR_PORT,
    EXECUTOR_TOKEN_DIR,
    EXECUTOR_TOKEN_FILE,
    LABEL_REVISION,
    LABEL_SLOT,
    MODEL_DIR,
    executor_pod_name,
    executor_service_name,
)

CONTAINER = "executor"


def executor_args(spec: ExecutorPoolSpec) -> list[str]:
    """The ``kvgate executor`` command line for this spec."""
    args = [
        "executor",
        "--model",
        spec.model.container_path,
        "--port",
        str(EXECUTOR_PORT),
        "--device",
        "cuda",
        "--dtype",
        spec.model.dtype.value,
    ]
    if spec.kv_cache.num_blocks is not None:
        args += ["--num-blocks", str(spec.kv_cache.num_blocks)]
    elif spec.kv_cache.memory_fraction is not None:
        args += ["--memory-fraction", repr(spec.kv_cache.memory_fraction)]
    args += ["--host-snapshot-blocks", str(spec.kv_cache.host_snapshot_blocks)]
    args += ["--token-file", EXECUTOR_TOKEN_FILE]
    # Reached by the pod IP; explicit, so that a loopback default outside Kubernetes is safe.
    args += ["--host", "0.0.0.0"]
    if spec.model.exit_policy is not None:
        args += ["--exit-policy", spec.model.exit_policy.value]
    if spec.gpus_per_executor > 1:
        # One rank per GPU of the pod, all in this container (rank 0 serves the step protocol).
        args += ["--tensor-parallel-size", str(spec.gpus_per_executor)]
    return args


# Per rank of a tensor-parallel pod: NCCL's shared-memory transport and torch's host buffers
# live in /dev/shm (a memory-backed emptyDir, counted against the container's memory).
SHM_PER_RANK_GIB = 2


def _shm_volume(spec: ExecutorPoolSpec) -> Manifest:
    volume: Manifest = {"name": "dshm", "emptyDir": {"medium": "Memory"}}
    if spec.gpus_per_executor > 1:
        volume["emptyDir"]["sizeLimit"] = f"{SHM_PER_RANK_GIB * spec.gpus_per_executor}Gi"
    return volume


def _nccl_env(spec: ExecutorPoolSpec) -> list[Manifest]:
    """The ranks of one pod meet on loopback; a hung collective aborts instead of blocking."""
    if spec.gpus_per_executor == 1:
        return []
    return [
        {"name": "NCCL_SOCKET_IFNAME", "value": "lo"},
        {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"},
    ]


def _model_volume(model: ModelSpec) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, mounts) for the checkpoint; none when it is baked into the image."""
    if model.volume is None:
        return [], []
    source: Manifest
    if model.volume.persistent_volume_claim is not None:
        claim = model.volume.persistent_volume_claim.claim_name
        source = {"persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    else:
        assert model.volume.host_path is not None  # exactly one source, by ModelVolume
        source = {"hostPath": {"path": model.volume.host_path.path, "type": "Directory"}}
    return [{"name": "model", **source}], [
        {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
    ]


def _env(pool: PoolRef, spec: ExecutorPoolSpec) -> list[Manifest]:
    env: list[Manifest] = [
        *telemetry_env(pool, spec.telemetry, COMPONENT_EXECUTOR),
        {"name": "HOME", "value": "/tmp"},
    ]
    return env + _nccl_env(spec)


def _pod_template(pool: PoolRef, spec: ExecutorPoolSpec) -> Manifest:
    """Everything of an executor pod that does not depend on its slot."""
    model_volumes, model_mounts = _model_volume(spec.model)
    gpus = str(spec.gpus_per_executor)
    container: Manifest = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy.value,
        "command": ["kvgate"],
        "args": executor_args(spec),
        "ports": [{"name": "http", "containerPort": EXECUTOR_PORT, "protocol": "TCP"}],
        "env": _env(pool, spec),
        # GPUs are an extended resource: requests must equal limits.
        "resources": resources(spec.resources, {GPU_RESOURCE: gpus}),
        # Loading a model can take minutes: the startup probe holds liveness off until then.
        "startupProbe": http_probe("/healthz", "http", period_s=10, failures=90),
        "livenessProbe": http_probe("/healthz", "http", period_s=10, failures=3),
        "readinessProbe": http_probe("/readyz", "http", period_s=5, failures=3),
        "securityContext": container_security_context(),
        "volumeMounts": [
            {"name": "executor-token", "mountPath": EXECUTOR_TOKEN_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *model_mounts,
        ],
    }
    pod_spec: Manifest = {
        "subdomain": executor_service_name(pool.name),
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": [
            secret_volume(
                "executor-token", spec.token_secret.name, {spec.token_secret.key: "token"}
            ),
            tmp_volume(),
            _shm_volume(spec),
            *model_volumes,
        ],
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": ref.name} for ref in spec.image_pull_secrets]
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [
            item.model_dump(mode="json", by_alias=True, exclude_none=True)
            for item in spec.tolerations
        ]
    if spec.affinity is not None:
        pod_spec["affinity"] = copy.deepcopy(spec.affinity)
    return {
        "labels": labels(pool, COMPONENT_EXECUTOR),
        "annotations": {
            ANNOTATION_MODEL_FAMILY: spec.model.family.value,
            ANNOTATION_MODEL_LOOPS: str(spec.model.loops),
        },
        "spec": pod_spec,
    }


def executor_revision(pool: PoolRef, spec: ExecutorPoolSpec) -> str:
    """The hash of the pod template: equal revisions mean interchangeable pods."""
    return spec_hash(_pod_template(pool, spec))


def build_executor_pod(pool: PoolRef, spec: ExecutorPoolSpec, slot: int) -> Manifest:
    template = _pod_template(pool, spec)
    name = executor_pod_name(pool.name, slot)
    meta = object_meta(pool, name, COMPONENT_EXECUTOR)
    meta["labels"] = {
        **template["labels"],
        LABEL_SLOT: str(slot),
        LABEL_REVISION: spec_hash(template),
    }
    meta["annotations"] = dict(template["annotations"])
    pod_spec: dict[str, Any] = {"hostname": name, **template["spec"]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def build_executor_service(pool: PoolRef) -> Manifest:
    """Headless: one DNS record per ready executor (``<pod>.<pool>-executors``), for metrics
    scraping and debugging. The admission service connects to pod IPs it is given."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(pool, executor_service_name(pool.name), COMPONENT_EXECUTOR),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(pool, COMPONENT_EXECUTOR),
            "ports": [
                {"name": "http", "port": EXECUTOR_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
