"""The harness's own dockerd: shared by overlapping sessions, stopped by the last one out.

Uses a private cache directory, so it starts a second, throw-away engine and never touches
the one the session's Kafka broker runs on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.docker_engine import SYSTEM_SOCKET, EnginePaths, docker_engine, engine_answers
from tests.harness.system import is_root

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180, func_only=True)]

REPO_ROOT = Path(__file__).resolve().parents[2]

# A second test session: holds the engine until a line arrives on stdin.
_OTHER_SESSION = """
import sys
from pathlib import Path
from tests.harness.docker_engine import docker_engine
with docker_engine(Path(sys.argv[1]), progress=lambda _: None) as engine:
    print(engine.host, engine.managed, flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    if not is_root():
        pytest.skip("starting dockerd needs root")
    if SYSTEM_SOCKET.exists() and engine_answers(f"unix://{SYSTEM_SOCKET}"):
        pytest.skip("a system engine answers at /var/run/docker.sock; the harness uses that one")
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    cache = tmp_path / "cache"
    yield cache
    # Whatever happened, leave no engine behind.
    from tests.harness.docker_engine import stop_managed_engine

    stop_managed_engine(EnginePaths.for_cache(cache))


def test_engine_is_shared_and_stopped_by_the_last_session(private_cache: Path) -> None:
    paths = EnginePaths.for_cache(private_cache)
    other = subprocess.Popen(
        [sys.executable, "-c", _OTHER_SESSION, str(private_cache)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert other.stdin is not None and other.stdout is not None
    try:
        host, managed = other.stdout.readline().split()
        assert (host, managed) == (paths.host, "True")

        # This session joins the running engine and leaves while the other still uses it.
        with docker_engine(private_cache, progress=lambda _: None) as engine:
            assert engine == type(engine)(host=paths.host, managed=True)
        assert engine_answers(paths.host), "stopped while another session used it"

        other.stdin.write("done\n")
        other.stdin.flush()
        assert other.wait(timeout=60) == 0
    finally:
        if other.poll() is None:
            other.kill()
    assert not engine_answers(paths.host), "the last session out did not stop the engine"
    assert not paths.pidfile.exists()

    # A later session starts it afresh and stops it again.
    with docker_engine(private_cache, progress=lambda _: None) as engine:
        assert engine.managed and engine_answers(engine.host)
    assert not engine_answers(paths.host)
