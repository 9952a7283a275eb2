"""Host-side plumbing the harness shares: cache paths, locks, logged commands, apt, free ports.

Everything the harness installs or builds lives under one cache directory,
``${KVGATE_CACHE:-$HOME/.cache/kvgate}``, so ``rm -rf`` of that directory (after stopping the
engine, see docs/testing.md) returns the machine to its first-run state. Slow steps write their
output to ``<cache>/logs/<step>.log`` instead of the terminal; a failure raises
:class:`HarnessError` carrying the tail of that log, so CI output shows the cause.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Protocol

log = logging.getLogger("kvgate.harness")

#: Receives one human-readable line per slow phase ("building the Kafka image ...").
Progress = Callable[[str], None]

_LOG_TAIL_CHARS = 4000
_APT_LOCK_TIMEOUT_S = 300


class HarnessError(RuntimeError):
    """The harness could not provide what a test needs; the message says why and what to do."""


def log_progress(message: str) -> None:
    """The default :data:`Progress`: the ``kvgate.harness`` logger."""
    log.info("%s", message)


class _LineWriter(Protocol):
    def write_line(self, line: str) -> object: ...


def progress_to(reporter: _LineWriter | None, label: str) -> Progress:
    """Progress logged and, when pytest's terminal reporter is given, shown as ``[label] ...``."""

    def emit(message: str) -> None:
        log_progress(message)
        if reporter is not None:
            reporter.write_line(f"[{label}] {message}")

    return emit


def cache_root() -> Path:
    """The harness cache: ``$KVGATE_CACHE`` when set, else ``~/.cache/kvgate``."""
    configured = os.environ.get("KVGATE_CACHE")
    if configured is not None and configured.strip() == "":
        raise HarnessError("KVGATE_CACHE is set but empty; unset it or give it a directory")
    root = Path(configured) if configured else Path.home() / ".cache" / "kvgate"
    root = root.expanduser().absolute()
    root.mkdir(parents=True, exist_ok=True)
    return root


def is_root() -> bool:
    return os.geteuid() == 0


@contextlib.contextmanager
def file_lock(path: Path, *, shared: bool = False) -> Iterator[IO[bytes]]:
    """Hold an ``flock`` on ``path`` for the block (blocking until it is granted).

    flock locks die with the process, so a crashed session never leaves a stale lock behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield handle
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def log_tail(path: Path, chars: int = _LOG_TAIL_CHARS) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return "(no log written)"
    return data[-chars:].decode("utf-8", errors="replace")


def run_logged(
    argv: Sequence[str],
    log_path: Path,
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> None:
    """Run ``argv`` to completion with stdout+stderr appended to ``log_path``.

    Raises :class:`HarnessError` (with the log tail) on a non-zero exit or after ``timeout_s``.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}
    with log_path.open("ab") as sink:
        sink.write(f"\n$ {' '.join(argv)}\n".encode())
        sink.flush()
        try:
            completed = subprocess.run(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise HarnessError(
                f"{argv[0]} did not finish within {timeout_s:.0f} s; log {log_path}:\n"
                f"{log_tail(log_path)}"
            ) from exc
        except FileNotFoundError as exc:
            raise HarnessError(f"command not found: {argv[0]}") from exc
    if completed.returncode != 0:
        raise HarnessError(
            f"{' '.join(argv[:4])} ... exited with {completed.returncode}; log {log_path}:\n"
            f"{log_tail(log_path)}"
        )


@contextlib.contextmanager
def _services_not_started() -> Iterator[None]:
    """Keep package maintainer scripts from starting daemons (e.g. docker.io's dockerd).

    Debian's invoke-rc.d asks ``/usr/sbin/policy-rc.d``; exit code 101 means "do not start".
    Container images usually ship one; when absent, install one for the duration of the call.
    """
    policy = Path("/usr/sbin/policy-rc.d")
    if policy.exists():
        yield
        return
    policy.write_text("#!/bin/sh\n# kvgate test harness: no services during apt-get\nexit 101\n")
    policy.chmod(0o755)
    try:
        yield
    finally:
        policy.unlink(missing_ok=True)


def apt_install(packages: Sequence[str], log_path: Path, progress: Progress) -> None:
    """Install Debian packages non-interactively (root only), refreshing the lists if needed."""
    if not is_root():
        raise HarnessError(
            f"{' '.join(packages)} is not installed and installing it needs root; "
            f"install it yourself (apt-get install {' '.join(packages)})"
        )
    if shutil.which("apt-get") is None:
        raise HarnessError(f"{' '.join(packages)} is missing and this machine has no apt-get")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    install = [
        "apt-get",
        "-o",
        f"DPkg::Lock::Timeout={_APT_LOCK_TIMEOUT_S}",
        "install",
        "-y",
        "--no-install-recommends",
        *packages,
    ]
    progress(f"installing {' '.join(packages)} with apt-get (log: {log_path})")
    with _services_not_started():
        try:
            run_logged(install, log_path, timeout_s=900, env=env)
        except HarnessError:
            # A fresh machine may have stale or no package lists: refresh once and retry.
            run_logged(["apt-get", "update"], log_path, timeout_s=600, env=env)
            run_logged(install, log_path, timeout_s=900, env=env)


def ensure_command(command: str, package: str, log_path: Path, progress: Progress) -> str:
    """The path of ``command``, installing Debian ``package`` first when it is missing."""
    found = shutil.which(command)
    if found is None:
        apt_install([package], log_path, progress)
        found = shutil.which(command)
    if found is None:
        raise HarnessError(f"installed {package} but {command} is still not on PATH")
    return found


def _mounts_under(directory: Path) -> list[str]:
    prefix = str(directory.resolve())
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    return [point for point in points if point == prefix or point.startswith(prefix + "/")]


def remove_tree(directory: Path) -> None:
    """``rm -rf`` that never deletes through a mount point left inside ``directory``.

    A failed debootstrap can leave /proc or /sys mounted in its target, and a dockerd killed
    hard can leave mounts in its exec root; ``shutil.rmtree`` would descend into them.
    Mounts are lazily unmounted first; if any remains, nothing is deleted.
    """
    if not directory.exists():
        return
    for point in sorted(_mounts_under(directory), reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    remaining = _mounts_under(directory)
    if remaining:
        raise HarnessError(f"refusing to delete {directory}: still mounted: {remaining}")
    shutil.rmtree(directory)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_accepts(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_until(
    condition: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.1, what: str
) -> None:
    """Poll ``condition`` until it holds; after ``timeout_s``, HarnessError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return
        if time.monotonic() >= deadline:
            raise HarnessError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)
