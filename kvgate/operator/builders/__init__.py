"""Pure manifest builders: (pool, spec) in, Kubernetes objects (JSON-ready dicts) out.

No I/O and no clock: the same inputs always build the same objects, so a hash of a built object
says whether the live one is current (see ``common.spec_hash``).
"""

from kvgate.operator.builders.admission import (
    build_admin_token_secret,
    build_admission_config,
    build_admission_configmap,
    build_admission_deployment,
    build_admission_service,
    render_admission_config,
)
from kvgate.operator.builders.common import PoolRef, spec_hash
from kvgate.operator.builders.executor import (
    build_executor_pod,
    build_executor_service,
    executor_args,
    executor_revision,
)

__all__ = [
    "PoolRef",
    "build_admin_token_secret",
    "build_admission_config",
    "build_admission_configmap",
    "build_admission_deployment",
    "build_admission_service",
    "build_executor_pod",
    "build_executor_service",
    "executor_args",
    "executor_revision",
    "render_admission_config",
    "spec_hash",
]
