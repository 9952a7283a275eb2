"""The Kafka broker handle the integration tests use: a harness-run container or an external one.

The container runs the image from :mod:`tests.harness.kafka_image` through testcontainers'
``DockerContainer`` on the **host network**: Kafka listens on ``127.0.0.1:<port>`` with a port
chosen before start-up and advertises exactly that address, so clients never see a translated
address, and ``restart()`` comes back at the same bootstrap address. Its log directory lives
on a named volume, so a restart (graceful or SIGKILL) keeps every committed record.

Fault injection for later tests: ``pause()`` freezes the broker (connections still open at the
TCP level, requests time out), ``unpause()`` resumes it, ``restart(hard=...)`` stops or kills it
and starts it again on the same data. These block until the broker answers metadata again;
an async test that must keep its own event loop running meanwhile calls them through
``asyncio.to_thread``.

With ``KAFKA_BOOTSTRAP`` set, :class:`ExternalKafka` stands in: the same ``bootstrap``, and
:class:`FaultInjectionUnavailable` from the fault methods (the fixtures turn that into a skip).
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import docker
from docker.errors import APIError, NotFound
from docker.models.containers import Container

from tests.harness.kafka_client import wait_for_broker
from tests.harness.kafka_image import KafkaImage
from tests.harness.system import HarnessError, free_port
from tests.harness.tls import TlsMaterial, properties_value

LISTEN_HOST = "127.0.0.1"
DATA_MOUNT = "/var/lib/kafka"
READY_TIMEOUT_S = 90.0
GRACEFUL_STOP_TIMEOUT_S = 30
OWNER_LABEL = "dev.kvgate.harness.owner"
ROLE_LABEL = "dev.kvgate.harness.role"

# testcontainers-python reads these when it is imported; configure_testcontainers() also sets
# them on its live configuration object. Ryuk's image cannot be pulled here, TC_HOST and the
# connection mode stop it from guessing a bridge gateway inside a VM that has /.dockerenv.
TESTCONTAINERS_ENV = {
    "TESTCONTAINERS_RYUK_DISABLED": "true",
    "TC_HOST": LISTEN_HOST,
    "TESTCONTAINERS_CONNECTION_MODE": "docker_host",
}


class FaultInjectionUnavailable(HarnessError):
    """pause/unpause/restart asked of a broker the harness does not run."""


class KafkaBroker(Protocol):
    @property
    def bootstrap(self) -> str: ...

    @property
    def controllable(self) -> bool:
        """Whether pause/unpause/restart work (only for the harness's own container)."""
        ...

    @property
    def tls(self) -> TlsEndpoint | None:
        """The TLS listener, where the broker has one."""
        ...

    def pause(self) -> None: ...

    def unpause(self) -> None: ...

    def restart(self, *, hard: bool = False) -> None: ...

    def stop(self) -> None: ...

    def logs(self) -> str: ...


@dataclass(frozen=True)
class TlsEndpoint:
    """The broker's TLS listener: dial ``bootstrap`` trusting ``ca_file`` (hostname checked)."""

    bootstrap: str
    ca_file: Path


@dataclass(frozen=True)
class BrokerPorts:
    kafka: int
    controller: int
    tls: int | None = None

    @classmethod
    def pick(cls, *, with_tls: bool = False) -> BrokerPorts:
        ports: list[int] = []
        while len(ports) < (3 if with_tls else 2):
            port = free_port(LISTEN_HOST)
            if port not in ports:
                ports.append(port)
        return cls(kafka=ports[0], controller=ports[1], tls=ports[2] if with_tls else None)


def _listeners(ports: BrokerPorts, tls: TlsMaterial | None) -> dict[str, str]:
    if (ports.tls is None) != (tls is None):
        raise ValueError("a TLS listener needs both a TLS port and TLS material")
    listeners = {"PLAINTEXT": ports.kafka, "CONTROLLER": ports.controller}
    advertised = {"PLAINTEXT": ports.kafka}
    settings: dict[str, str] = {}
    if tls is not None and ports.tls is not None:
        listeners["SSL"] = advertised["SSL"] = ports.tls
        settings = {
            "listener.name.ssl.ssl.keystore.type": "PEM",
            "listener.name.ssl.ssl.keystore.certificate.chain": properties_value(
                tls.certificate_pem
            ),
            "listener.name.ssl.ssl.keystore.key": properties_value(tls.private_key_pem),
        }
    return {
        "listeners": ",".join(f"{name}://{LISTEN_HOST}:{p}" for name, p in listeners.items()),
        "advertised.listeners": ",".join(
            f"{name}://{LISTEN_HOST}:{p}" for name, p in advertised.items()
        ),
        # Listener name -> security protocol; only the SSL listener encrypts.
        "listener.security.protocol.map": ",".join(
            f"{name}:{'SSL' if name == 'SSL' else 'PLAINTEXT'}" for name in listeners
        ),
        **settings,
    }


def server_properties(
    ports: BrokerPorts, tls: TlsMaterial | None = None, log_dir: str = f"{DATA_MOUNT}/data"
) -> str:
    """Single-node KRaft (combined broker and controller) bound to and advertising 127.0.0.1.

    Listeners: PLAINTEXT for clients, CONTROLLER for KRaft, and SSL (server certificate only,
    no client authentication) when ``tls`` is given. Replication factors and min ISR are 1 for
    every internal topic, and group joins and transactions are tuned for tests: no initial
    rebalance delay, one offsets partition, and a short broker session so a hard restart is
    ready in seconds.
    """
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.bootstrap.servers": f"{LISTEN_HOST}:{ports.controller}",
        **_listeners(ports, tls),
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": log_dir,
        "num.partitions": "1",
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        # A SIGKILLed broker re-registers only after its old session expires (default 9 s).
        "broker.session.timeout.ms": "3000",
        "broker.heartbeat.interval.ms": "500",
        "auto.create.topics.enable": "false",
    }
    return "".join(f"{key}={value}\n" for key, value in settings.items())


def configure_testcontainers() -> None:
    os.environ.update(TESTCONTAINERS_ENV)
    from testcontainers.core.config import ConnectionMode, testcontainers_config

    testcontainers_config.ryuk_disabled = True
    testcontainers_config.tc_host_override = LISTEN_HOST
    testcontainers_config.connection_mode_override = ConnectionMode.docker_host


def _process_identity(pid: int) -> str | None:
    """``<pid>:<start time in clock ticks>``, stable for a process's lifetime, None if gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - one short read
    except FileNotFoundError:
        return None
    return f"{pid}:{stat.rsplit(')', 1)[1].split()[19]}"


def reap_orphans(client: docker.DockerClient) -> list[str]:
    """Remove harness containers (and their volumes) whose owning test process is gone.

    Ryuk cannot run here, so a session killed hard would otherwise leave a 1 GB JVM behind.
    """
    reaped = []
    for container in client.containers.list(all=True, filters={"label": OWNER_LABEL}):
        owner = container.labels.get(OWNER_LABEL, "")
        pid_text = owner.split(":", 1)[0]
        if pid_text.isdigit() and _process_identity(int(pid_text)) == owner:
            continue
        volumes = [m["Name"] for m in container.attrs.get("Mounts", []) if m.get("Name")]
        container.remove(force=True)
        for volume in volumes:
            with contextlib.suppress(NotFound):
                client.volumes.get(volume).remove(force=True)
        reaped.append(container.name)
    return reaped


class ContainerKafka:
    """The harness's own broker container; see the module docstring for its guarantees."""

    def __init__(
        self, container: Container, ports: BrokerPorts, volume: str, ca_file: Path | None
    ) -> None:
        self._container = container
        self.ports = ports
        self.volume = volume
        self._ca_file = ca_file

    @property
    def bootstrap(self) -> str:
        return f"{LISTEN_HOST}:{self.ports.kafka}"

    @property
    def controllable(self) -> bool:
        return True

    @property
    def tls(self) -> TlsEndpoint | None:
        if self.ports.tls is None or self._ca_file is None:
            return None
        return TlsEndpoint(f"{LISTEN_HOST}:{self.ports.tls}", self._ca_file)

    @property
    def name(self) -> str:
        return str(self._container.name)

    @classmethod
    def start(
        cls,
        engine_host: str,
        image: KafkaImage,
        *,
        tls: TlsMaterial | None = None,
        name_prefix: str = "kvgate-kafka",
    ) -> ContainerKafka:
        """Start a broker from ``image`` on a fresh volume and wait until it answers.

        With ``tls``, the broker also has a TLS listener serving that certificate.
        """
        configure_testcontainers()
        from testcontainers.core.container import DockerContainer

        name = f"{name_prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        ports = BrokerPorts.pick(with_tls=tls is not None)
        owner = _process_identity(os.getpid())
        assert owner is not None  # this process is alive
        spec = (
            DockerContainer(
                image.reference,
                docker_client_kw={"environment": {**os.environ, "DOCKER_HOST": engine_host}},
                name=name,
                network_mode="host",
                labels={OWNER_LABEL: owner, ROLE_LABEL: "kafka"},
            )
            .with_env("KAFKA_SERVER_PROPERTIES", server_properties(ports, tls))
            .with_volume_mapping(f"{name}-data", DATA_MOUNT, "rw")
        )
        spec.start()
        ca_file = None if tls is None else tls.ca_file
        broker = cls(spec.get_wrapped_container(), ports, f"{name}-data", ca_file)
        try:
            broker.wait_ready()
        except BaseException:
            broker.stop()
            raise
        return broker

    def _reload(self) -> str:
        self._container.reload()
        return str(self._container.status)

    def _not_starting_reason(self) -> str | None:
        status = self._reload()
        if status in ("running", "created", "restarting"):
            return None
        return f"container {self.name} is {status}; its log ends with:\n{self.logs()[-3000:]}"

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Block until a metadata request succeeds; returns the seconds waited."""
        return wait_for_broker(
            self.bootstrap, timeout_s=timeout_s, still_starting=self._not_starting_reason
        )

    def pause(self) -> None:
        """Freeze every broker process (``docker pause``): requests hang until unpause."""
        self._container.pause()

    def unpause(self) -> None:
        self._container.unpause()
        self.wait_ready()

    def restart(self, *, hard: bool = False) -> None:
        """Stop (SIGTERM, or SIGKILL when ``hard``) and start again on the same data and port."""
        if self._reload() == "paused":
            self._container.unpause()
        if hard:
            self._container.kill(signal="SIGKILL")
        else:
            self._container.stop(timeout=GRACEFUL_STOP_TIMEOUT_S)
        self._container.wait(timeout=GRACEFUL_STOP_TIMEOUT_S + 30)
        self._container.start()
        self.wait_ready()

    def ensure_running(self) -> None:
        """Undo whatever fault a test left behind: unpause or start, then wait until ready."""
        status = self._reload()
        if status == "paused":
            self._container.unpause()
        elif status != "running":
            self._container.start()
        self.wait_ready()

    def stop(self) -> None:
        """Remove the container and its volume (idempotent)."""
        client = self._container.client
        assert client is not None
        with contextlib.suppress(NotFound):
            self._container.remove(force=True)
        with contextlib.suppress(NotFound):
            client.volumes.get(self.volume).remove(force=True)

    def logs(self) -> str:
        try:
            return bytes(self._container.logs()).decode("utf-8", errors="replace")
        except (NotFound, APIError) as exc:
            return f"(no logs: {exc})"


_BOOTSTRAP_ENTRY = re.compile(r"^[A-Za-z0-9.\-]+:\d{1,5}$|^\[[0-9A-Fa-f:]+\]:\d{1,5}$")


def parse_bootstrap(value: str) -> str:
    """Validate a ``host:port[,host:port...]`` list; raise HarnessError naming the bad entry."""
    entries = [entry.strip() for entry in value.split(",")]
    if not entries or any(not entry for entry in entries):
        raise HarnessError(f"KAFKA_BOOTSTRAP={value!r} has an empty entry; expected host:port,...")
    for entry in entries:
        port_text = entry.rsplit(":", 1)[-1]
        if not _BOOTSTRAP_ENTRY.match(entry) or not 0 < int(port_text) < 65536:
            raise HarnessError(f"KAFKA_BOOTSTRAP entry {entry!r} is not host:port")
    return ",".join(entries)


class ExternalKafka:
    """A broker the harness does not run (``KAFKA_BOOTSTRAP``): no fault injection, no logs."""

    def __init__(self, bootstrap: str) -> None:
        self._bootstrap = parse_bootstrap(bootstrap)

    @property
    def bootstrap(self) -> str:
        return self._bootstrap

    @property
    def controllable(self) -> bool:
        return False

    @property
    def tls(self) -> TlsEndpoint | None:
        return None

    def _unavailable(self, action: str) -> FaultInjectionUnavailable:
        return FaultInjectionUnavailable(
            f"cannot {action} the broker: KAFKA_BOOTSTRAP={self._bootstrap} is an external "
            "broker; unset KAFKA_BOOTSTRAP to run tests that need the harness's container"
        )

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        return wait_for_broker(self._bootstrap, timeout_s=timeout_s)

    def pause(self) -> None:
        raise self._unavailable("pause")

    def unpause(self) -> None:
        raise self._unavailable("unpause")

    def restart(self, *, hard: bool = False) -> None:
        raise self._unavailable("restart")

    def stop(self) -> None:
        """Nothing to stop: the harness did not start it."""

    def logs(self) -> str:
        return f"(external broker at {self._bootstrap}: its logs are not available here)"
