"""How a kvgate process connects to Kafka: one definition of the connection settings (servers,
TLS, mutual TLS, SASL PLAIN/SCRAM) and of turning them into aiokafka's keyword arguments.

The admission service (``kafka`` section of its settings), the gateway (``--kafka-*`` flags and
the chart's ``kafka.security``), ``kvgate produce``/``results`` and ``kvgate replay`` all build
their clients with :func:`client_options`, so a broker that one of them reaches over TLS or SASL
the others reach the same way. Secrets never need to be inline: the SASL password can be a file
(a mounted Kubernetes Secret), read when the clients are made.

Also the two admin reads that the service and the batch feeder both make when they set up their
topics: each topic's partition count, and waiting for topics just created to appear.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Any, Self

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.helpers import create_ssl_context
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from kvgate.protocol.enums import SaslMechanism, SecurityProtocol

NonEmptySecret = Annotated[SecretStr, Field(min_length=1)]
BootstrapServers = Annotated[str, Field(pattern=r"^[^\s,]+(,[^\s,]+)*$")]

_SASL_PROTOCOLS = (SecurityProtocol.SASL_PLAINTEXT, SecurityProtocol.SASL_SSL)
_TLS_PROTOCOLS = (SecurityProtocol.SSL, SecurityProtocol.SASL_SSL)


class SettingsError(ValueError):
    """Settings that cannot be used; the message names every bad setting, one per line."""


def read_secret(inline: SecretStr | None, path: Path | None, what: str) -> str | None:
    """``inline``'s value, else the stripped content of ``path`` (None when neither is set).
    An unreadable or empty file is a :class:`SettingsError` naming ``what``."""
    if inline is not None:
        return inline.get_secret_value()
    if path is None:
        return None
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise SettingsError(f"{what}: cannot read {path}: {exc.strerror}") from exc
    if not value:
        raise SettingsError(f"{what}: {path} is empty")
    return value


class KafkaConnection(BaseModel):
    """Where Kafka is and how to prove who we are to it (and it to us).

    TLS (``SSL``, ``SASL_SSL``) trusts ``ssl_cafile`` (else the system's trust store) and checks
    the broker's host name unless ``ssl_check_hostname`` is off; ``ssl_certfile`` with
    ``ssl_keyfile`` presents a client certificate (mutual TLS). SASL (``SASL_PLAINTEXT``,
    ``SASL_SSL``) needs a mechanism, a user name and a password (inline or from a file).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: BootstrapServers
    client_id: Annotated[str, Field(min_length=1)] = "kvgate"
    request_timeout_ms: Annotated[int, Field(ge=1000)] = 30000
    security_protocol: SecurityProtocol = SecurityProtocol.PLAINTEXT
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: NonEmptySecret | None = None
    sasl_password_file: Path | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    ssl_check_hostname: bool = True

    @model_validator(mode="after")
    def _security_matches_protocol(self) -> Self:
        uses_sasl = self.security_protocol in _SASL_PROTOCOLS
        if uses_sasl and (self.sasl_mechanism is None or not self.sasl_username):
            raise ValueError(
                f"security_protocol {self.security_protocol} needs sasl_mechanism and sasl_username"
            )
        if uses_sasl and self.sasl_password is None and self.sasl_password_file is None:
            raise ValueError("SASL needs sasl_password or sasl_password_file")
        if not uses_sasl and self.sasl_mechanism is not None:
            raise ValueError(
                f"sasl_mechanism needs security_protocol SASL_PLAINTEXT or SASL_SSL, not "
                f"{self.security_protocol}"
            )
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together (mutual TLS)")
        tls_files = (self.ssl_cafile, self.ssl_certfile, self.ssl_keyfile)
        if not self.uses_tls and any(f is not None for f in tls_files):
            raise ValueError(
                f"ssl_* files need security_protocol SSL or SASL_SSL, not {self.security_protocol}"
            )
        return self

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol in _TLS_PROTOCOLS

    def sasl_password_value(self) -> str | None:
        return read_secret(self.sasl_password, self.sasl_password_file, "kafka.sasl_password")

    def describe(self) -> str:
        """One line for logs and errors: servers and security, never a secret."""
        how = self.security_protocol.value
        if self.sasl_mechanism is not None:
            how += f" {self.sasl_mechanism.value} as {self.sasl_username}"
        if self.uses_tls:
            how += f", CA {self.ssl_cafile or 'system trust store'}"
            if self.ssl_certfile is not None:
                how += f", client certificate {self.ssl_certfile}"
        return f"{self.bootstrap_servers} ({how})"


def client_options(connection: KafkaConnection) -> dict[str, Any]:
    """The keyword arguments every aiokafka client (producer, consumer, admin) of ``connection``
    shares. Reads the SASL password file and the TLS files now: a missing file is an error here,
    at start, not at the first reconnect."""
    options: dict[str, Any] = {
        "bootstrap_servers": connection.bootstrap_servers,
        "client_id": connection.client_id,
        "security_protocol": connection.security_protocol.value,
        "request_timeout_ms": connection.request_timeout_ms,
    }
    if connection.sasl_mechanism is not None:
        options["sasl_mechanism"] = connection.sasl_mechanism.value
        options["sasl_plain_username"] = connection.sasl_username
        options["sasl_plain_password"] = connection.sasl_password_value()
    if connection.uses_tls:
        context = create_ssl_context(
            cafile=connection.ssl_cafile,
            certfile=connection.ssl_certfile,
            keyfile=connection.ssl_keyfile,
        )
        context.check_hostname = connection.ssl_check_hostname
        options["ssl_context"] = context
    return options


async def partition_counts(admin: AIOKafkaAdminClient, topics: list[str]) -> dict[str, int]:
    """Partitions of each of ``topics`` that exists (missing ones are left out)."""
    existing = set(await admin.list_topics())
    present = [t for t in topics if t in existing]
    if not present:
        return {}
    return {d["topic"]: len(d["partitions"]) for d in await admin.describe_topics(present)}


async def wait_for_topics(
    admin: AIOKafkaAdminClient, topics: list[str], timeout_s: float = 30.0
) -> dict[str, int] | None:
    """Every one of ``topics``' partition count once all exist (a created topic takes a moment
    to appear in the metadata); None when they have not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = await partition_counts(admin, topics)
        if all(t in counts for t in topics):
            return counts
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.1)
