"""The gateway's settings and its API keys, parsed at the boundary.

API keys come from a YAML/JSON file (a mounted Secret) and/or ``KVGATE_GATEWAY_API_KEY``::

    keys:
      - name: team-a          # the label in metrics and logs (never the key itself)
        key: sk-...           # or key_file: /var/run/secrets/team-a
        min_priority: 0       # the most important priority this key may ask for (lower = more)
        default_priority: 10
        requests_per_s: 20    # token-bucket rate limit; burst = requests_per_s unless set
        burst: 40
        tenant: team-a        # whose share its requests are served from (default: the name)

Rate limits are counted in each replica's memory: with ``rate_limit_replicas`` N (the chart sets
the replica count, the HPA's maximum when it scales), each replica enforces 1/N of every key's
rate and burst, so N replicas together never allow more than the configured rate.

The gateway's Kafka connection (servers, TLS, SASL) is the :class:`KafkaConnection` every
kvgate process uses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Final

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvgate.batch.settings import BatchSettings
from kvgate.kafka_connection import KafkaConnection
from kvgate.protocol import topics
from kvgate.protocol.tenants import TenantName
from kvgate.web.guard import HttpLimits

API_KEY_ENV: Final = "KVGATE_GATEWAY_API_KEY"
TopicName = Annotated[str, Field(min_length=1, max_length=249, pattern=r"^[a-zA-Z0-9._-]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ApiKey(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
    key: Annotated[str, Field(min_length=16)] | None = None
    key_file: Path | None = None
    min_priority: int = 0
    default_priority: int | None = None  # None: max(0, min_priority)
    requests_per_s: Annotated[float, Field(gt=0)] | None = None  # None: no limit
    burst: Annotated[float, Field(ge=1)] | None = None
    # The tenant on its requests' records: fair sharing and quotas in the admission service.
    tenant: TenantName | None = None  # None: the key's name

    @model_validator(mode="after")
    def _one_key(self) -> ApiKey:
        if (self.key is None) == (self.key_file is None):
            raise ValueError(f"key {self.name}: give exactly one of key and key_file")
        if self.default_priority is not None and self.default_priority < self.min_priority:
            raise ValueError(f"key {self.name}: default_priority is below min_priority")
        return self

    def secret(self) -> str:
        if self.key is not None:
            return self.key
        assert self.key_file is not None
        value = self.key_file.read_text().strip()
        if len(value) < 16:
            raise ValueError(f"key {self.name}: {self.key_file} holds fewer than 16 characters")
        return value

    @property
    def tenant_name(self) -> str:
        return self.tenant if self.tenant is not None else self.name

    @property
    def priority(self) -> int:
        return (
            self.default_priority
            if self.default_priority is not None
            else max(0, self.min_priority)
        )


class KeysFile(_Strict):
    keys: list[ApiKey]


class ModelRoute(_Strict):
    """One model served: the pool's request and results topics, and its tokenizer (streamed
    token ids become text here)."""

    name: Annotated[str, Field(min_length=1, max_length=256)]
    request_topic: TopicName = topics.REQUESTS
    result_topic: TopicName = topics.RESULTS
    tokenizer_file: Path | None = None


class GatewaySettings(_Strict):
    kafka: KafkaConnection
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    # /metrics, /healthz, /readyz without a key on this port; on the API port they need a key
    # unless open_health is set.
    health_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    open_health: bool = False
    replica_id: Annotated[str, Field(pattern=r"^[a-zA-Z0-9._-]{1,100}$")] = "gateway-0"
    abort_topic: TopicName = topics.ABORTS
    models: Annotated[list[ModelRoute], Field(min_length=1)]
    keys: list[ApiKey] = Field(default_factory=list)
    allow_anonymous: bool = False  # no key needed (local use); anonymous gets priority 0
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    # Connections the kernel queues before the gateway accepts them: a burst of clients that
    # connect at once must not find a full queue (its connections reset). The kernel caps it at
    # net.core.somaxconn.
    listen_backlog: Annotated[int, Field(ge=1, le=65535)] = 2048
    default_max_tokens: Annotated[int, Field(ge=1)] = 256  # chat, when the body sets none
    answer_cache_size: Annotated[int, Field(ge=0)] = 10_000
    reply_retention_ms: Annotated[int, Field(ge=60_000)] = 3_600_000
    # How long the broker may hold a fetch of the reply partition that found nothing new. Kafka
    # answers as soon as a reply arrives, so this only sets how often an idle reader asks; a
    # broker that holds an empty fetch for its whole wait (Tansu) adds up to this much to every
    # reply: the local stack sets a few milliseconds.
    reply_fetch_max_wait_ms: Annotated[int, Field(ge=1, le=10_000)] = 500
    # How many replicas share each key's rate limit (each enforces 1/n of it).
    rate_limit_replicas: Annotated[int, Field(ge=1, le=10_000)] = 1
    # HTTP requests: body size (413 above), JSON nesting (400 above), how long the headers may
    # take from their first byte and the body once the headers are in (408).
    max_body_bytes: Annotated[int, Field(ge=1024, le=64 * 2**20)] = 2**20
    max_json_depth: Annotated[int, Field(ge=4, le=128)] = 32
    head_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    body_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    # /v1/files and /v1/batches, with their store (None: not served; docs/batch.md).
    batches: BatchSettings | None = None

    @property
    def reply_topic(self) -> str:
        return f"{topics.REPLIES_PREFIX}{self.replica_id}"

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            max_body_bytes=self.max_body_bytes,
            head_timeout_s=self.head_timeout_s,
            body_timeout_s=self.body_timeout_s,
        )

    @model_validator(mode="after")
    def _unique(self) -> GatewaySettings:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError("model names must be unique")
        keys = [k.name for k in self.keys]
        if len(set(keys)) != len(keys):
            raise ValueError("API key names must be unique")
        if not self.keys and not self.allow_anonymous:
            raise ValueError(
                f"no API keys: give --api-keys-file or ${API_KEY_ENV}, or allow anonymous access"
            )
        return self


def load_keys(path: Path | None) -> list[ApiKey]:
    """Keys from ``path`` and from ``KVGATE_GATEWAY_API_KEY`` (named ``env``)."""
    keys: list[ApiKey] = []
    if path is not None:
        keys.extend(KeysFile.model_validate(yaml.safe_load(path.read_text())).keys)
    from_env = os.environ.get(API_KEY_ENV)
    if from_env:
        keys.append(ApiKey(name="env", key=from_env))
    return keys
