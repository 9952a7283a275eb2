"""The admission service's settings: one typed model, read from a YAML file and ``KVGATE_*``.

Sources, strongest first: ``KVGATE_<SECTION>__<KEY>`` environment variables (for example
``KVGATE_KAFKA__BOOTSTRAP_SERVERS``), then the YAML file given with ``--config``, then a
caller's own defaults (``load_settings(defaults=...)``: the local stack's), then the defaults
below; ``load_settings``' overrides rank above all of them. The file's top-level sections are
the ones the operator writes into the pool's ConfigMap (``kafka``, ``scheduler``, ``admin``,
``executors``, ``telemetry``) plus ``limits``, ``shutdown``, ``placement`` (where requests go:
``placement.py``) and ``tenants`` (quotas: ``quotas.py``). Unknown keys are errors, and
:func:`load_settings` turns every problem into one line naming the setting
(``kafka.session_timeout_ms: ...``), so a bad file fails at start.

Secrets never need to be in the file: the SASL password, admin token and executor token can each
be given as a ``*_file`` path (a mounted Kubernetes Secret) or through the environment.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Self

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvgate.admission_service.placement import PlacementSettings
from kvgate.admission_service.tool_parsers import ToolCallFormat
from kvgate.kafka_connection import KafkaConnection, NonEmptySecret, SettingsError, read_secret
from kvgate.protocol import topics
from kvgate.protocol.admin import ExecutorSpec
from kvgate.protocol.records import BATCH_PRIORITY, TokenRecords
from kvgate.protocol.tenants import TenantsSettings
from kvgate.scheduler.config import Policy, SchedulerConfig
from kvgate.web.guard import HttpLimits

ENV_PREFIX = "KVGATE_"
TopicName = Annotated[str, Field(min_length=1, max_length=249, pattern=r"^[a-zA-Z0-9._-]+$")]
PositiveSeconds = Annotated[float, Field(gt=0.0)]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ExactlyOnce(StrEnum):
    """``auto``: transactions when the broker supports them (probed at start)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class IsolationLevel(StrEnum):
    READ_COMMITTED = "read_committed"
    READ_UNCOMMITTED = "read_uncommitted"


class OffsetReset(StrEnum):
    EARLIEST = "earliest"
    LATEST = "latest"


class KafkaSettings(KafkaConnection):
    """The service's Kafka section: the connection (servers, TLS, SASL: ``KafkaConnection``,
    shared with the gateway and the clients), its topics, consumer group and delivery."""

    request_topic: TopicName = topics.REQUESTS
    result_topic: TopicName = topics.RESULTS
    token_topic: TopicName | None = None  # the optional token stream
    token_records: TokenRecords = TokenRecords.PER_STEP  # the token stream's records
    abort_topic: TopicName = topics.ABORTS
    dlq_topic: TopicName = topics.DEAD_LETTER
    group_id: Annotated[str, Field(min_length=1, max_length=255)] = "kvgate-admission"
    client_id: Annotated[str, Field(min_length=1)] = "kvgate-admission"
    # Topics missing at start are created with this many partitions (results, tokens and dead
    # letters get the request topic's count, so results stay co-partitioned with requests).
    create_topics: bool = True
    partitions: Annotated[int, Field(ge=1, le=10000)] = 6
    replication_factor: Annotated[int, Field(ge=1, le=32)] = 1
    exactly_once: ExactlyOnce = ExactlyOnce.AUTO
    transactional_id_prefix: Annotated[str, Field(min_length=1)] | None = None  # group_id
    transaction_timeout_ms: Annotated[int, Field(ge=1000)] = 60000
    isolation_level: IsolationLevel = IsolationLevel.READ_COMMITTED
    auto_offset_reset: OffsetReset = OffsetReset.EARLIEST
    # A killed replica's partitions move to the others after the session timeout: 6 s (the
    # lowest a broker accepts by default, group.min.session.timeout.ms) keeps that failover
    # under 10 s; the heartbeat is a third of it, as Kafka advises.
    session_timeout_ms: Annotated[int, Field(ge=500)] = 6000
    heartbeat_interval_ms: Annotated[int, Field(ge=100)] = 2000
    max_poll_interval_ms: Annotated[int, Field(ge=1000)] = 300000
    max_poll_records: Annotated[int, Field(ge=1, le=100000)] = 500
    # How long the broker may hold a fetch of requests that found nothing new. Kafka answers as
    # soon as a request arrives (fetch_min_bytes 1), so this only sets how often an idle
    # consumer asks; a broker that holds an empty fetch for its whole wait (Tansu) adds up to
    # this much to every request's latency: the local stack sets a few milliseconds.
    fetch_max_wait_ms: Annotated[int, Field(ge=1, le=10000)] = 500
    # How often finished work is committed (results + consumed offsets, one transaction).
    commit_interval_ms: Annotated[int, Field(ge=1, le=60000)] = 100
    # Commit cycles of a partition that keep failing this long fail readiness (/readyz names
    # the partition, its unwritten answers and the error) until one succeeds again.
    commit_stall_timeout_s: PositiveSeconds = 30.0
    # Reading the results partition on assignment (to skip requests already answered) gives up
    # after this long; the partition is then consumed without a skip set (duplicates possible).
    skip_scan_timeout_s: PositiveSeconds = 60.0
    # A metadata request checks that Kafka answers about this often (jittered within half the
    # interval; backing off to 4 intervals while checks fail); one unanswered after the timeout
    # (or failing) marks Kafka unreachable, which /readyz reports until a check succeeds.
    health_check_interval_s: PositiveSeconds = 2.0
    health_check_timeout_s: PositiveSeconds = 5.0

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError(
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be below "
                f"session_timeout_ms ({self.session_timeout_ms})"
            )
        topics = [self.request_topic, self.result_topic, self.abort_topic, self.dlq_topic]
        if self.token_topic is not None:
            topics.append(self.token_topic)
        if len(set(topics)) != len(topics):
            raise ValueError(f"the topics must be distinct, got {topics}")
        return self

    @property
    def transactional_prefix(self) -> str:
        return self.transactional_id_prefix or self.group_id


class AdminSettings(_Section):
    # Loopback unless told otherwise: the admin API can change membership and drain
    # executors. In Kubernetes the operator's pod config sets 0.0.0.0 (reached by the pod IP).
    host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080  # 0: any free port (tests)
    token: NonEmptySecret | None = None
    token_file: Path | None = None
    # HTTP requests: the headers must arrive within head_timeout_s of their first byte and a
    # body within body_timeout_s (408 after), of at most max_body_bytes (413 above).
    head_timeout_s: PositiveSeconds = 10.0
    body_timeout_s: PositiveSeconds = 30.0
    max_body_bytes: Annotated[int, Field(ge=1024, le=64 * 2**20)] = 2**20

    def token_value(self) -> str | None:
        """The bearer token mutations need; None means mutations are refused."""
        return read_secret(self.token, self.token_file, "admin.token")

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            max_body_bytes=self.max_body_bytes,
            head_timeout_s=self.head_timeout_s,
            body_timeout_s=self.body_timeout_s,
        )


class ExecutorsSettings(_Section):
    """Executor membership (a static list here, or pushed through the admin API) and sessions."""

    members: list[ExecutorSpec] = Field(default_factory=list)
    token: NonEmptySecret | None = None
    token_file: Path | None = None
    connect_timeout_s: PositiveSeconds = 10.0
    heartbeat_s: PositiveSeconds = 5.0
    # A step result must arrive within this long, or the executor is treated as lost.
    step_timeout_s: PositiveSeconds = 120.0
    reconnect_initial_s: PositiveSeconds = 0.2
    reconnect_max_s: PositiveSeconds = 10.0
    enable_prefix_caching: bool = True
    # Text prompts and text results through the tokenizer the executors serve (GET
    # /v1/tokenizer); every executor must serve the same one. Excludes limits.tokenizer_file.
    tokenizer_from_executors: bool = False
    # A request present on this many executors that failed under it is failed itself (it may be
    # what breaks them), instead of being restored on yet another executor.
    max_request_failures: Annotated[int, Field(ge=1)] = 3
    # A drain moves its requests at a token boundary to another executor with their KV (both
    # executors must serve snapshots); any failure falls back to recompute.
    migrate_on_drain: bool = True
    # One snapshot's fetch and staging on the receiver; past it the request is recomputed.
    migration_timeout_s: PositiveSeconds = 30.0
    # How long a leaving executor holds an export nobody fetched.
    migration_ttl_s: PositiveSeconds = 60.0

    @model_validator(mode="after")
    def _members(self) -> Self:
        names = [m.name for m in self.members]
        if len(set(names)) != len(names):
            raise ValueError(f"executor names must be unique, got {names}")
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ValueError("reconnect_max_s must be at least reconnect_initial_s")
        return self

    def token_value(self) -> str | None:
        return read_secret(self.token, self.token_file, "executors.token")


class LimitsSettings(_Section):
    """What a request may ask for, checked before it is queued."""

    max_message_bytes: Annotated[int, Field(ge=64)] = 1 << 20
    max_prompt_tokens: Annotated[int, Field(ge=1)] = 8192
    max_output_tokens: Annotated[int, Field(ge=1)] = 8192
    priority_min: int = -1000
    priority_max: int = 1000
    # Backpressure: request partitions are paused while this many requests wait (queued but not
    # running), and resumed once the count falls to ``resume_waiting_requests``.
    max_waiting_requests: Annotated[int, Field(ge=1)] = 4096
    resume_waiting_requests: Annotated[int, Field(ge=0)] | None = None
    tokenizer_file: Path | None = None  # enables text prompts and text in results
    # How tool calls are read from an output when a request's tool_choice is auto: the format
    # the chat template asks for (auto), or one named (tool_parsers.ToolCallFormat).
    tool_call_parser: ToolCallFormat = ToolCallFormat.AUTO
    # Text prompts longer than this many characters are rejected before tokenizing (default:
    # 16 per allowed prompt token — more than any tokenizer packs into one token — so no
    # acceptable prompt is refused and no hopeless one costs tokenizer time).
    max_prompt_chars: Annotated[int, Field(ge=1)] | None = None
    # Text is tokenized on this many threads, off the event loop; intake pauses while this many
    # texts wait for (or are in) tokenization.
    tokenizer_threads: Annotated[int, Field(ge=1, le=64)] = 2
    max_pending_tokenizations: Annotated[int, Field(ge=1)] = 64
    # A text prompt read before any executor has served the pool's tokenizer (a replica just
    # started, or given its executors a moment later) waits this long for one, then is
    # rejected; the waiting texts count towards max_pending_tokenizations.
    tokenizer_wait_s: PositiveSeconds = 300.0
    # Aborts are remembered this long, for requests that arrive after their abort.
    abort_memory_s: PositiveSeconds = 600.0
    # One answer per request id: an id answered within this window (here, or by an earlier
    # owner of its partition: read back from the results topic) is a duplicate, dead-lettered
    # without a result. At most idempotency_max_ids are remembered (the oldest go first).
    idempotency_window_s: PositiveSeconds = 600.0
    idempotency_max_ids: Annotated[int, Field(ge=1)] = 200_000

    @model_validator(mode="after")
    def _ranges(self) -> Self:
        if self.priority_min > self.priority_max:
            raise ValueError(
                f"priority_min ({self.priority_min}) exceeds priority_max ({self.priority_max})"
            )
        if self.resume_mark >= self.max_waiting_requests:
            raise ValueError(
                f"resume_waiting_requests ({self.resume_mark}) must be below "
                f"max_waiting_requests ({self.max_waiting_requests})"
            )
        return self

    @property
    def prompt_char_limit(self) -> int:
        return self.max_prompt_chars or 16 * self.max_prompt_tokens

    @property
    def resume_mark(self) -> int:
        if self.resume_waiting_requests is not None:
            return self.resume_waiting_requests
        return self.max_waiting_requests * 3 // 4


class TelemetrySettings(_Section):
    service_name: Annotated[str, Field(min_length=1)] = "kvgate-admission"
    otlp_endpoint: Annotated[str, Field(pattern=r"^https?://")] | None = None
    spans_file: Path | None = None  # also write every span as a JSON line here
    model_name: Annotated[str, Field(min_length=1)] = "kvgate"  # gen_ai.request.model


class ShutdownSettings(_Section):
    # On SIGTERM, running work has this long to finish before it is handed off (left
    # uncommitted, so the next owner of its partition runs it again).
    grace_period_s: Annotated[float, Field(ge=0.0)] = 30.0
    # After the grace period, everything else (hand-off, the last commit cycles, closing the
    # executor sessions, producers and consumer) shares this budget; a step still running when
    # it is spent is abandoned: its answers are not durable and their requests run again on the
    # partitions' next owners. The pod's terminationGracePeriodSeconds must cover both.
    closing_timeout_s: Annotated[float, Field(gt=0.0)] = 20.0


def _service_scheduler_defaults(value: object) -> object:
    """The service keeps one plan in flight per executor, and runs the batches' class as the
    scheduler's background class (under priority order, where classes exist), unless told
    otherwise."""
    if not isinstance(value, Mapping):
        return value
    defaults: dict[str, object] = {"async_scheduling": True}
    if str(value.get("policy", Policy.PRIORITY)) == Policy.PRIORITY:
        defaults["background_priority"] = BATCH_PRIORITY
    return {**defaults, **value}


_FILE_DATA: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("kvgate_settings_file")


class _FileSource(PydanticBaseSettingsSource):
    """The parsed YAML file (handed over through a context variable by ``load_settings``)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return _FILE_DATA.get({}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_FILE_DATA.get({}))


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    kafka: KafkaSettings
    scheduler: SchedulerConfig = SchedulerConfig(
        async_scheduling=True, background_priority=BATCH_PRIORITY
    )
    admin: AdminSettings = AdminSettings()
    executors: ExecutorsSettings = ExecutorsSettings()
    limits: LimitsSettings = LimitsSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    shutdown: ShutdownSettings = ShutdownSettings()
    placement: PlacementSettings = PlacementSettings()
    tenants: TenantsSettings = TenantsSettings()

    @field_validator("scheduler", mode="before")
    @classmethod
    def _scheduler_defaults(cls, value: object) -> object:
        return _service_scheduler_defaults(value)

    @model_validator(mode="after")
    def _one_tokenizer(self) -> Self:
        if self.executors.tokenizer_from_executors and self.limits.tokenizer_file is not None:
            raise ValueError(
                "set at most one of limits.tokenizer_file and executors.tokenizer_from_executors"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _FileSource(settings_cls)


def read_settings_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"settings file {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SettingsError(f"settings file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(
            f"settings file {path} must hold a mapping of sections, not {type(data).__name__}"
        )
    return data


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem, each naming the setting: ``kafka.partitions: ...``."""
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        lines.append(f"{where}: {item['msg']}")
    return "\n".join(lines)


def _beneath(data: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` over ``defaults``, section by section: keys of a section merge, data's win."""
    merged = {k: dict(v) if isinstance(v, Mapping) else v for k, v in defaults.items()}
    for section, values in data.items():
        base = merged.get(section)
        if isinstance(base, dict) and isinstance(values, Mapping):
            merged[section] = {**base, **values}
        else:
            merged[section] = values
    return merged


def load_settings(
    path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    defaults: Mapping[str, Any] | None = None,
) -> ServiceSettings:
    """Settings from, weakest first: ``defaults`` (a caller's own, under every other source),
    ``path`` (optional), the environment, ``overrides``.

    Raises :class:`SettingsError` naming each bad setting.
    """
    data = read_settings_file(path) if path is not None else {}
    token = _FILE_DATA.set(_beneath(data, defaults or {}))
    try:
        return ServiceSettings(**dict(overrides or {}))
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from None
    finally:
        _FILE_DATA.reset(token)
