"""``kvgate run`` as a real process on 127.0.0.1, as a user starts it: its stdout read line by
line as it is printed (the banner), its log (stderr) in a file.

The moment the banner's last line is read, every address it names is asked once, with no retry
(``AtBanner``): a banner printed before some part answered shows there as a refusal or a state
other than "ready". The banner's lines and every later stdout line are kept, so a test can count
banners for the whole life of the process.
"""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BANNER_FIRST = "kvgate is serving"
BANNER_LAST = "Ctrl-C to stop."


@dataclass(frozen=True)
class Answer:
    status: int | None  # None: no HTTP answer at all (refused, reset, timed out)
    body: str


def ask_once(url: str) -> Answer:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return Answer(response.status, response.read().decode())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.read().decode())
    except (urllib.error.URLError, OSError) as exc:
        return Answer(None, repr(exc))


@dataclass(frozen=True)
class Banner:
    text: str
    fields: dict[str, str]  # "model", "OpenAI API", "Kafka bootstrap", "admin API": first word

    @classmethod
    def parse(cls, lines: list[str]) -> Banner:
        fields = {}
        for line in lines:
            found = re.match(r"  (model|OpenAI API|Kafka bootstrap|admin API) +(\S+)", line)
            if found:
                fields[found.group(1)] = found.group(2)
        return cls("".join(lines), fields)

    @property
    def openai_url(self) -> str | None:
        url = self.fields.get("OpenAI API", "off")
        return None if url == "off" else url


@dataclass(frozen=True)
class AtBanner:
    """What the banner's addresses answered the moment its last line was read."""

    models: Answer | None  # GET {OpenAI}/models; None without the door
    service_ready: Answer  # GET {admin}/readyz
    executors: Answer  # GET {admin}/v1/executors

    def executor_states(self) -> list[str]:
        if self.executors.status != 200:
            return []
        return [e["state"] for e in json.loads(self.executors.body)["executors"]]


@dataclass
class RunProcess:
    process: subprocess.Popen[str]
    log: Path
    banner: Banner
    at_banner: AtBanner
    started_to_banner_s: float
    stdout: list[str] = field(default_factory=list)  # every line, appended while it runs

    def banners_printed(self) -> int:
        return sum(1 for line in self.stdout if line.startswith(BANNER_FIRST))


def _read_lines(stream: object, into: queue.Queue[str | None]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        into.put(line)
    into.put(None)


def stop_process(process: subprocess.Popen[Any]) -> None:
    """SIGTERM (``kvgate run`` stops its stack in order), SIGKILL after 30 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def kvgate_run(
    out: Path, *args: str, env: dict[str, str], timeout_s: float = 240
) -> Iterator[RunProcess]:
    """``kvgate run --out-dir OUT ARGS``, yielded once its banner is printed (and asked)."""
    log = out / "run.log"
    lines: queue.Queue[str | None] = queue.Queue()
    began = time.monotonic()
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvgate", "run", "--out-dir", str(out), *args],
            env=env, stdout=subprocess.PIPE, stderr=sink, text=True, bufsize=1,
            start_new_session=True,
        )  # fmt: skip
    reader = threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True)
    reader.start()
    try:
        printed: list[str] = []
        banner: list[str] = []
        deadline = began + timeout_s
        while not banner or banner[-1].strip() != BANNER_LAST:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                tail = log.read_text()[-3000:]
                raise AssertionError(f"no banner in {timeout_s:.0f} s: {tail}") from None
            if line is None:
                raise AssertionError(
                    f"kvgate run exited ({process.wait()}) before its banner: "
                    f"{''.join(printed)}{log.read_text()[-3000:]}"
                )
            printed.append(line)
            if line.startswith(BANNER_FIRST) or banner:
                banner.append(line)
        started_to_banner_s = time.monotonic() - began
        parsed = Banner.parse(banner)
        admin, openai = parsed.fields["admin API"], parsed.openai_url
        at_banner = AtBanner(
            models=None if openai is None else ask_once(f"{openai}/models"),
            service_ready=ask_once(f"{admin}/readyz"),
            executors=ask_once(f"{admin}/v1/executors"),
        )
        running = RunProcess(process, log, parsed, at_banner, started_to_banner_s, printed)
        threading.Thread(target=_keep, args=(lines, running.stdout), daemon=True).start()
        yield running
    finally:
        stop_process(process)


def _keep(lines: queue.Queue[str | None], into: list[str]) -> None:
    while (line := lines.get()) is not None:
        into.append(line)
