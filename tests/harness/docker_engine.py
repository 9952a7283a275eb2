"""Find a Docker engine for the integration tests, or start one by hand.

Order of preference:

1. ``DOCKER_HOST`` when set: it must answer, otherwise the session fails with that reason (an
   explicit setting is never silently replaced).
2. ``/var/run/docker.sock`` when a daemon answers there.
3. The harness's own ``dockerd`` (already running from another session, or started now):
   data root under ``<cache>/docker/data-root``, socket and exec root under a short runtime
   directory (unix socket paths are limited to 107 bytes), ``--config-file`` pointing at an
   empty file of its own so a host ``/etc/docker/daemon.json`` cannot conflict. It runs with
   ``--bridge=none --iptables=false --ip-masq=false``: the harness's containers use the host
   network, so the engine never needs a bridge and never edits the host's firewall rules,
   which other engines on the same machine may own. Storage is overlay2, falling back to vfs;
   the driver that worked is remembered because a data root only opens with its own driver.

Lifetime of the harness's own engine: every session holds a shared ``flock`` on
``users.lock`` while it uses the engine; when a session ends it tries to take that lock
exclusively and, if no other session holds it, stops the engine by its PID. Joining and
leaving happen under ``start.lock``, so a session can never join an engine that is stopping.
An engine the harness did not start (1 and 2) is never stopped.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO

import docker
from docker.errors import DockerException

from tests.harness.system import (
    HarnessError,
    Progress,
    ensure_command,
    file_lock,
    is_root,
    log_progress,
    log_tail,
    remove_tree,
    wait_until,
)

DOCKERD_READY_TIMEOUT_S = 60.0
DOCKERD_STOP_TIMEOUT_S = 30.0
_PROBE_TIMEOUT_S = 5
SYSTEM_SOCKET = Path("/var/run/docker.sock")


class StorageDriver(Enum):
    OVERLAY2 = "overlay2"
    VFS = "vfs"


@dataclass(frozen=True)
class DockerEngine:
    """An engine that answers at ``host`` (a ``DOCKER_HOST`` URL)."""

    host: str
    # True when this is the harness's own dockerd: the last session using it stops it.
    managed: bool

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.host, timeout=120)


@dataclass(frozen=True)
class EnginePaths:
    """Where the harness's own dockerd keeps its state; derived from the cache directory."""

    state_dir: Path
    run_dir: Path

    @classmethod
    def for_cache(cls, cache: Path) -> EnginePaths:
        state_dir = cache / "docker"
        digest = hashlib.sha256(str(state_dir).encode()).hexdigest()[:10]
        run_base = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
        return cls(state_dir=state_dir, run_dir=run_base / f"kvgate-docker-{digest}")

    @property
    def data_root(self) -> Path:
        return self.state_dir / "data-root"

    @property
    def log(self) -> Path:
        return self.state_dir / "dockerd.log"

    @property
    def driver_file(self) -> Path:
        return self.state_dir / "storage-driver"

    @property
    def config_file(self) -> Path:
        return self.state_dir / "daemon.json"

    @property
    def start_lock(self) -> Path:
        return self.state_dir / "start.lock"

    @property
    def users_lock(self) -> Path:
        return self.state_dir / "users.lock"

    @property
    def socket(self) -> Path:
        return self.run_dir / "docker.sock"

    @property
    def exec_root(self) -> Path:
        return self.run_dir / "exec"

    @property
    def pidfile(self) -> Path:
        return self.run_dir / "dockerd.pid"

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    @property
    def containerd_namespace(self) -> str:
        # Distinct from Docker's default "moby", in case dockerd adopts a system containerd
        # that another engine also uses.
        return f"kvgate-{self.run_dir.name.removeprefix('kvgate-docker-')}"


def engine_answers(host: str) -> bool:
    """Whether a Docker engine answers a ping at ``host`` within a few seconds."""
    try:
        client = docker.DockerClient(base_url=host, timeout=_PROBE_TIMEOUT_S)
    except (DockerException, OSError):
        return False
    try:
        return bool(client.ping())
    except (DockerException, OSError):
        return False
    finally:
        client.close()


def dockerd_argv(dockerd: str, paths: EnginePaths, driver: StorageDriver) -> list[str]:
    return [
        dockerd,
        f"--config-file={paths.config_file}",
        f"--data-root={paths.data_root}",
        f"--exec-root={paths.exec_root}",
        f"--pidfile={paths.pidfile}",
        f"--host={paths.host}",
        f"--storage-driver={driver.value}",
        f"--containerd-namespace={paths.containerd_namespace}",
        f"--containerd-plugins-namespace={paths.containerd_namespace}-plugins",
        "--bridge=none",
        "--iptables=false",
        "--ip-masq=false",
        "--log-level=warn",
    ]


def running_managed_pid(paths: EnginePaths) -> int | None:
    """The PID of the harness's dockerd for these paths, if that process is alive."""
    try:
        pid = int(paths.pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # PIDs are reused: only a dockerd started with our data root counts.
    if f"--data-root={paths.data_root}".encode() not in cmdline:
        return None
    return pid


def find_running_engine(paths: EnginePaths) -> DockerEngine | None:
    configured = os.environ.get("DOCKER_HOST")
    if configured:
        if engine_answers(configured):
            managed = configured == paths.host and running_managed_pid(paths) is not None
            return DockerEngine(host=configured, managed=managed)
        raise HarnessError(
            f"DOCKER_HOST={configured} does not answer; start that engine or unset DOCKER_HOST "
            "so the harness uses /var/run/docker.sock or starts its own dockerd"
        )
    system_host = f"unix://{SYSTEM_SOCKET}"
    if SYSTEM_SOCKET.exists() and engine_answers(system_host):
        return DockerEngine(host=system_host, managed=False)
    if paths.socket.exists() and engine_answers(paths.host):
        return DockerEngine(host=paths.host, managed=running_managed_pid(paths) is not None)
    return None


def _driver_order(paths: EnginePaths) -> list[StorageDriver]:
    try:
        return [StorageDriver(paths.driver_file.read_text().strip())]
    except (FileNotFoundError, ValueError):
        return [StorageDriver.OVERLAY2, StorageDriver.VFS]


def _launch(dockerd: str, paths: EnginePaths, driver: StorageDriver) -> subprocess.Popen[bytes]:
    with paths.log.open("ab") as sink:
        sink.write(f"\n=== kvgate harness: starting dockerd with {driver.value}\n".encode())
        sink.flush()
        # A session of its own: Ctrl-C in pytest must not kill an engine other sessions share.
        return subprocess.Popen(
            dockerd_argv(dockerd, paths, driver),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_ready(process: subprocess.Popen[bytes], paths: EnginePaths) -> bool:
    """True once the engine answers; False if dockerd exited first."""
    deadline = time.monotonic() + DOCKERD_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if paths.socket.exists() and engine_answers(paths.host):
            return True
        time.sleep(0.2)
    _stop_pid(process.pid)
    raise HarnessError(
        f"dockerd did not answer within {DOCKERD_READY_TIMEOUT_S:.0f} s; log {paths.log}:\n"
        f"{log_tail(paths.log)}"
    )


def start_dockerd(paths: EnginePaths, progress: Progress) -> DockerEngine:
    if not is_root():
        raise HarnessError(
            "no Docker engine answers (DOCKER_HOST, /var/run/docker.sock) and starting one "
            "needs root; start Docker, or set KAFKA_BOOTSTRAP to use an external broker"
        )
    stuck = running_managed_pid(paths)
    if stuck is not None:
        # Never start a second dockerd on the same data root: that corrupts it.
        raise HarnessError(
            f"the harness's dockerd (pid {stuck}) runs but does not answer at {paths.socket}; "
            f"see {paths.log}, then stop it (python -m tests.harness clean)"
        )
    dockerd = ensure_command("dockerd", "docker.io", paths.state_dir / "apt.log", progress)
    for directory in (paths.state_dir, paths.data_root, paths.run_dir, paths.exec_root):
        directory.mkdir(parents=True, exist_ok=True)
    if not paths.config_file.exists():
        paths.config_file.write_text(json.dumps({}) + "\n")
    # A dockerd killed hard leaves its pidfile and socket; dockerd refuses to reuse them.
    paths.pidfile.unlink(missing_ok=True)
    paths.socket.unlink(missing_ok=True)
    for driver in _driver_order(paths):
        progress(f"starting dockerd ({driver.value}, socket {paths.socket})")
        process = _launch(dockerd, paths, driver)
        if _wait_ready(process, paths):
            paths.driver_file.write_text(driver.value + "\n")
            return DockerEngine(host=paths.host, managed=True)
        paths.pidfile.unlink(missing_ok=True)
        paths.socket.unlink(missing_ok=True)
    raise HarnessError(f"dockerd exited during start-up; log {paths.log}:\n{log_tail(paths.log)}")


def _stop_pid(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    try:
        wait_until(
            lambda: not Path(f"/proc/{pid}").exists() or _is_zombie(pid),
            timeout_s=DOCKERD_STOP_TIMEOUT_S,
            interval_s=0.2,
            what=f"dockerd (pid {pid}) to stop",
        )
    except HarnessError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # Our own child: reap it so it does not linger as a zombie in this process.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def stop_managed_engine(paths: EnginePaths) -> bool:
    """Stop the harness's dockerd for these paths if it runs; True if one was stopped."""
    pid = running_managed_pid(paths)
    if pid is None:
        return False
    _stop_pid(pid)
    # Runtime state only (socket, pidfile, exec root); images stay in the data root.
    remove_tree(paths.run_dir)
    return True


@contextlib.contextmanager
def docker_engine(cache: Path, progress: Progress = log_progress) -> Iterator[DockerEngine]:
    """Use a Docker engine for the block; stop the harness's own engine if this is its last user.

    ``DOCKER_HOST`` is exported for the block (testcontainers and the docker CLI read it) and
    restored afterwards.
    """
    paths = EnginePaths.for_cache(cache)
    paths.state_dir.mkdir(parents=True, exist_ok=True)
    users = paths.users_lock.open("ab")
    try:
        with file_lock(paths.start_lock):
            fcntl.flock(users.fileno(), fcntl.LOCK_SH)
            engine = find_running_engine(paths) or start_dockerd(paths, progress)
        previous_host = os.environ.get("DOCKER_HOST")
        os.environ["DOCKER_HOST"] = engine.host
        try:
            yield engine
        finally:
            _restore_env("DOCKER_HOST", previous_host)
            with file_lock(paths.start_lock):
                fcntl.flock(users.fileno(), fcntl.LOCK_UN)
                if engine.managed and _sole_user(users):
                    progress("stopping the harness's dockerd (no other session uses it)")
                    stop_managed_engine(paths)
    finally:
        users.close()


def _sole_user(users: IO[bytes]) -> bool:
    """Whether no other session holds ``users.lock`` (this one must have released it)."""
    fileno = users.fileno()
    try:
        fcntl.flock(fileno, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fileno, fcntl.LOCK_UN)
    return True


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
