"""A server binary the harness runs for a test: its own directory, a log file, a clean stop.

The process is asked to die with the thread that started it (Linux's parent-death signal, set
by util-linux's ``setpriv`` where it is installed), so a test run killed hard never leaves a
collector or a Prometheus behind listening on a port. Start a daemon from a thread that outlives
it (a fixture's, not ``asyncio.to_thread``'s).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from tests.harness.system import HarnessError, Progress, log_tail

_STOP_TIMEOUT_S = 30


def _dying_with_parent(argv: Sequence[str]) -> list[str]:
    setpriv = shutil.which("setpriv")
    return list(argv) if setpriv is None else [setpriv, "--pdeathsig", "TERM", "--", *argv]


class Daemon:
    """One running server in a private temporary directory (:attr:`workdir`)."""

    def __init__(self, name: str, progress: Progress) -> None:
        self.name = name
        self.progress = progress
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kvgate-{name}-"))
        self.log_path = self.workdir / f"{name}.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, argv: Sequence[str]) -> None:
        self._log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            _dying_with_parent(argv),
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return log_tail(self.log_path)

    def wait_until(self, condition: Callable[[], bool], *, timeout_s: float, what: str) -> None:
        """Poll ``condition`` until it holds; fail early, with the log, if the process exits."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self._process is None or self._process.poll() is not None:
                code = None if self._process is None else self._process.returncode
                raise HarnessError(
                    f"{self.name} exited ({code}) before {what}; log {self.log_path}:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"{self.name}: no {what} after {timeout_s:.0f} s; log {self.log_path}:\n"
                    f"{self.log()}"
                )
            time.sleep(0.1)

    def stop(self, *, keep_files: bool = False) -> None:
        """SIGTERM, then SIGKILL after a grace period; the directory goes unless kept."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if not keep_files:
            shutil.rmtree(self.workdir, ignore_errors=True)
