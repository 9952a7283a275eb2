"""The ExecutorPool spec as typed models, and the one place a raw spec becomes one.

Field names are the CRD's camelCase (``alias_generator``); Python code uses snake_case. The CRD's
OpenAPI schema checks types, ranges and enums; the rules it cannot express (one field excludes
another, a family fixes the loop count, the scheduler's own cross-field checks) live here, so a
spec the API server accepted can still be refused with a clear reason — ``parse_spec`` raises
``InvalidSpecError`` naming every offending field by its path in the resource.

The scheduler settings are the admission service's own ``SchedulerConfig``: its ranges, enums and
validators apply unchanged, so the operator never accepts a setting the service would refuse.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Final

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from kvgate.operator.naming import MODEL_DIR, pool_name_problem
from kvgate.protocol import topics
from kvgate.protocol.enums import (
    DType,
    ExitPolicy,
    ModelFamily,
    PackagedModel,
    SaslMechanism,
    SecurityProtocol,
)
from kvgate.protocol.records import TokenRecords
from kvgate.protocol.tenants import TenantsSettings
from kvgate.scheduler.config import SchedulerConfig


class PullPolicy(StrEnum):
    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


class OtlpProtocol(StrEnum):
    """``OTEL_EXPORTER_OTLP_PROTOCOL`` of the pool's pods (kvgate/telemetry/setup.py)."""

    GRPC = "grpc"
    HTTP_PROTOBUF = "http/protobuf"


class TolerationOperator(StrEnum):
    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


GPU_RESOURCE: Final = "nvidia.com/gpu"
# Kubernetes' own pattern for resource quantities (apimachinery resource.Quantity).
QUANTITY_PATTERN: Final = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DNS_SUBDOMAIN_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
KAFKA_TOPIC_PATTERN: Final = r"^[a-zA-Z0-9._-]+$"
_QUANTITY = re.compile(QUANTITY_PATTERN)

ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
TopicName = Annotated[str, Field(max_length=249, pattern=KAFKA_TOPIC_PATTERN)]
SecretKey = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]
AbsolutePath = Annotated[str, Field(pattern=r"^/")]


class InvalidSpecError(ValueError):
    """A spec the operator refuses; ``message`` names each offending field and why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Spec(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        validate_by_alias=True,
        validate_by_name=True,
    )


class SecretKeyRef(_Spec):
    """One key of a Secret in the pool's namespace."""

    name: ObjectName
    key: SecretKey


class TokenSecretRef(_Spec):
    """The executor step token: the Secret and the key holding it."""

    name: ObjectName
    key: SecretKey = "token"


class LocalObjectRef(_Spec):
    name: ObjectName


class PersistentVolumeClaimSource(_Spec):
    claim_name: ObjectName


class HostPathSource(_Spec):
    path: AbsolutePath


class ModelVolume(_Spec):
    """A volume holding the checkpoint, mounted read-only at ``/models``; ``subPath`` names
    the model inside it: a Hugging Face directory or a ``.gguf`` file."""

    persistent_volume_claim: PersistentVolumeClaimSource | None = None
    host_path: HostPathSource | None = None
    sub_path: Annotated[str, Field(pattern=r"^$|^[^/]")] = ""

    @model_validator(mode="after")
    def _one_source(self) -> ModelVolume:
        if (self.persistent_volume_claim is None) == (self.host_path is None):
            raise ValueError("set exactly one of persistentVolumeClaim and hostPath")
        if ".." in self.sub_path.split("/"):
            raise ValueError("subPath must not contain '..'")
        return self


class ModelSpec(_Spec):
    family: ModelFamily
    path: AbsolutePath | None = None
    volume: ModelVolume | None = None
    packaged: PackagedModel | None = None
    loops: Annotated[int, Field(ge=1, le=64)] = 1
    dtype: DType = DType.BFLOAT16
    exit_policy: ExitPolicy | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        sources = [self.path, self.volume, self.packaged]
        if sum(source is not None for source in sources) != 1:
            raise ValueError(
                "set exactly one of path (in the image), volume and packaged "
                "(a model installed as a Python package in the executor image)"
            )
        if self.packaged is not None and self.family is not ModelFamily.LLAMA:
            raise ValueError(f"the packaged {self.packaged} is a llama model, not {self.family}")
        if self.family is ModelFamily.LLAMA and self.loops != 1:
            raise ValueError(
                f"family llama runs its layers once: loops must be 1, got {self.loops}"
            )
        if self.family is ModelFamily.LLAMA and self.exit_policy is not None:
            raise ValueError("exitPolicy applies to looped models only")
        return self

    @property
    def container_path(self) -> str:
        """Where the executor finds the checkpoint inside its container."""
        if self.path is not None:
            return self.path
        if self.packaged is not None:
            return self.packaged.model_ref
        assert self.volume is not None  # one of the three, by _consistent
        return f"{MODEL_DIR}/{self.volume.sub_path}".rstrip("/")


def _check_quantities(values: Mapping[str, str | int]) -> dict[str, str]:
    checked: dict[str, str] = {}
    for name, value in values.items():
        text = str(value)
        if not _QUANTITY.match(text):
            raise ValueError(f"{name}: {text!r} is not a Kubernetes quantity")
        checked[name] = text
    return checked


class ResourceRequirements(_Spec):
    """CPU, memory and other resources; GPUs come from ``gpusPerExecutor``, not from here."""

    requests: dict[str, str | int] = {}
    limits: dict[str, str | int] = {}

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, values: dict[str, str | int]) -> dict[str, str]:
        if GPU_RESOURCE in values:
            raise ValueError(
                f"do not set {GPU_RESOURCE} here; the pool sets it from gpusPerExecutor"
            )
        return _check_quantities(values)


class Toleration(_Spec):
    key: str | None = None
    operator: TolerationOperator | None = None
    value: str | None = None
    effect: TaintEffect | None = None
    toleration_seconds: int | None = None


class KvCacheSpec(_Spec):
    """Executor KV cache size: a block count or a fraction of free GPU memory (not both)."""

    num_blocks: Annotated[int, Field(ge=1)] | None = None
    memory_fraction: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    host_snapshot_blocks: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _one_size(self) -> KvCacheSpec:
        if self.num_blocks is not None and self.memory_fraction is not None:
            raise ValueError("set at most one of numBlocks and memoryFraction")
        return self


class KafkaTopics(_Spec):
    requests: TopicName = topics.REQUESTS
    results: TopicName = topics.RESULTS
    tokens: TopicName | None = None
    aborts: TopicName = topics.ABORTS
    dead_letter: TopicName = topics.DEAD_LETTER


class SaslSpec(_Spec):
    mechanism: SaslMechanism
    username: Annotated[str, Field(min_length=1)]
    password_secret: SecretKeyRef


class TlsSpec(_Spec):
    """Keys of one Secret: the CA bundle and, for mutual TLS, a client certificate and key."""

    secret_name: ObjectName
    ca: SecretKey | None = "ca.crt"
    certificate: SecretKey | None = None
    private_key: SecretKey | None = None

    @model_validator(mode="after")
    def _pair(self) -> TlsSpec:
        if (self.certificate is None) != (self.private_key is None):
            raise ValueError("certificate and privateKey go together")
        if self.ca is None and self.certificate is None:
            raise ValueError("name at least the ca key or a certificate and privateKey")
        return self


class KafkaSecurity(_Spec):
    protocol: SecurityProtocol = SecurityProtocol.PLAINTEXT
    sasl: SaslSpec | None = None
    tls: TlsSpec | None = None

    @model_validator(mode="after")
    def _matches_protocol(self) -> KafkaSecurity:
        uses_sasl = self.protocol in (
            SecurityProtocol.SASL_PLAINTEXT,
            SecurityProtocol.SASL_SSL,
        )
        uses_tls = self.protocol in (SecurityProtocol.SSL, SecurityProtocol.SASL_SSL)
        if uses_sasl and self.sasl is None:
            raise ValueError(f"protocol {self.protocol} needs sasl settings")
        if not uses_sasl and self.sasl is not None:
            raise ValueError(
                f"sasl settings need protocol SASL_PLAINTEXT or SASL_SSL, not {self.protocol}"
            )
        if not uses_tls and self.tls is not None:
            raise ValueError(f"tls settings need protocol SSL or SASL_SSL, not {self.protocol}")
        return self


class KafkaSpec(_Spec):
    bootstrap_servers: Annotated[str, Field(pattern=r"^[^\s,]+(,[^\s,]+)*$")]
    topics: KafkaTopics = KafkaTopics()
    group_id: Annotated[str, Field(min_length=1, max_length=255)] | None = None
    security: KafkaSecurity = KafkaSecurity()
    # Whether the admission service creates missing topics when it starts (with its own
    # partition and replication defaults). Off: topics are the Kafka administrator's.
    create_topics: bool = False
    # The token stream's records (the service's kafka.token_records); unset: its default.
    token_records: TokenRecords | None = None


class TelemetrySpec(_Spec):
    otlp_endpoint: Annotated[str, Field(pattern=r"^https?://")] | None = None
    otlp_protocol: OtlpProtocol | None = None  # unset: the pods' default, OTLP/HTTP
    service_name: Annotated[str, Field(min_length=1, max_length=128)] = "kvgate"


# Each replica needs a request partition of its own to be useful, and an executor.
MAX_ADMISSION_REPLICAS = 64


class AdmissionSpec(_Spec):
    """The pool's admission service. Several replicas share the pool: the request partitions
    by their consumer group, the executors by the operator (``shards.py``); 0 pauses
    consumption."""

    replicas: Annotated[int, Field(ge=0, le=MAX_ADMISSION_REPLICAS)] = 1
    image: Annotated[str, Field(min_length=1)] | None = None
    image_pull_policy: PullPolicy | None = None
    resources: ResourceRequirements = ResourceRequirements()


class AutoscalingSpec(_Spec):
    """Executors from the queue's load (semantics: ``autoscale.py`` and docs/operator.md).
    With it set, the operator owns ``spec.replicas`` and writes it through the scale
    subresource."""

    min_replicas: Annotated[int, Field(ge=0, le=1024)] = 1
    max_replicas: Annotated[int, Field(ge=1, le=1024)]
    target_consumer_lag_per_executor: Annotated[int, Field(ge=1)] | None = None
    target_waiting_per_executor: Annotated[int, Field(ge=1)] | None = None
    target_kv_cache_usage: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    scale_up_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = 0
    scale_down_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = 300
    max_scale_up_step: Annotated[int, Field(ge=1, le=1024)] = 4
    max_scale_down_step: Annotated[int, Field(ge=1, le=1024)] = 1
    scale_to_zero_after_seconds: Annotated[int, Field(ge=0, le=86400)] = 600
    # How often the load is read and a decision taken.
    sync_period_seconds: Annotated[int, Field(ge=1, le=600)] = 15

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas ({self.min_replicas}) exceeds maxReplicas ({self.max_replicas})"
            )
        targets = (
            self.target_consumer_lag_per_executor,
            self.target_waiting_per_executor,
            self.target_kv_cache_usage,
        )
        if all(target is None for target in targets):
            raise ValueError(
                "set at least one of targetConsumerLagPerExecutor, targetWaitingPerExecutor "
                "and targetKvCacheUsage"
            )
        return self


_SCHEDULER_FIELDS: Final = {to_camel(name): name for name in SchedulerConfig.model_fields}


class ExecutorPoolSpec(_Spec):
    replicas: Annotated[int, Field(ge=0, le=1024)] = 1
    gpus_per_executor: Annotated[int, Field(ge=1, le=16)] = 1
    image: Annotated[str, Field(min_length=1)]
    image_pull_policy: PullPolicy = PullPolicy.IF_NOT_PRESENT
    image_pull_secrets: list[LocalObjectRef] = []
    model: ModelSpec
    resources: ResourceRequirements = ResourceRequirements()
    node_selector: dict[str, str] = {}
    tolerations: list[Toleration] = []
    # Passed through to the pod as it is: the API server validates it as a core Affinity.
    affinity: dict[str, Any] | None = None
    kv_cache: KvCacheSpec = KvCacheSpec()
    scheduler: SchedulerConfig = SchedulerConfig()
    # Per-tenant quotas, enforced by the pool's admission service (docs/admission-service.md).
    tenants: TenantsSettings = TenantsSettings()
    kafka: KafkaSpec
    telemetry: TelemetrySpec = TelemetrySpec()
    token_secret: TokenSecretRef
    admission: AdmissionSpec = AdmissionSpec()
    drain_timeout_seconds: Annotated[int, Field(ge=1, le=86400)] = 300
    autoscaling: AutoscalingSpec | None = None

    @field_validator("scheduler", mode="before")
    @classmethod
    def _scheduler_from_camel_case(cls, value: object) -> object:
        """The CRD spells SchedulerConfig's fields in camelCase; anything else is refused."""
        if not isinstance(value, Mapping):
            return value
        converted: dict[str, object] = {}
        for key, item in value.items():
            if key not in _SCHEDULER_FIELDS:
                raise PydanticCustomError(
                    "unknown_setting",
                    "unknown scheduler setting '{key}'; known: {known}",
                    {"key": key, "known": ", ".join(sorted(_SCHEDULER_FIELDS))},
                )
            converted[_SCHEDULER_FIELDS[key]] = item
        return converted


def _location(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for index, item in enumerate(loc):
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        elif index > 0 and loc[0] == "scheduler":
            parts.append(to_camel(item))  # SchedulerConfig reports its snake_case names
        else:
            parts.append(item)
    return ".".join(["spec", *parts])


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem: ``spec.model.loops: Value error, family llama ...``."""
    lines = []
    for item in error.errors(include_url=False):
        message = str(item["msg"]).removeprefix("Value error, ")
        lines.append(f"{_location(tuple(item['loc']))}: {message}")
    return "; ".join(lines)


def parse_spec(pool_name: str, raw: Mapping[str, Any] | None) -> ExecutorPoolSpec:
    """The pool's spec as a typed model, or ``InvalidSpecError`` saying what is wrong."""
    problem = pool_name_problem(pool_name)
    if problem is not None:
        raise InvalidSpecError(f"metadata.name: {problem}")
    if raw is None:
        raise InvalidSpecError("spec: missing")
    try:
        # By alias only: the resource spells fields in camelCase, as the CRD schema does.
        return ExecutorPoolSpec.model_validate(dict(raw), by_alias=True, by_name=False)
    except ValidationError as error:
        raise InvalidSpecError(describe_validation_error(error)) from None
