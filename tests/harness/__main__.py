"""Manage the test harness's cache from the command line (run from the repository root).

python -m tests.harness prepare   # find/start Docker, build the Kafka image; then stop
python -m tests.harness status    # what is cached and whether the harness's dockerd runs
python -m tests.harness clean     # stop the harness's dockerd, delete the whole cache
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tests.harness.docker_engine import (
    EnginePaths,
    docker_engine,
    running_managed_pid,
    stop_managed_engine,
)
from tests.harness.kafka_image import ensure_kafka_image, image_recipe_hash
from tests.harness.system import HarnessError, cache_root, file_lock, remove_tree


def _progress(message: str) -> None:
    print(f"[kvgate harness] {message}", flush=True)


def prepare(cache: Path) -> int:
    started = time.monotonic()
    with docker_engine(cache, _progress) as engine:
        client = engine.client()
        try:
            image = ensure_kafka_image(client, cache, _progress)
        finally:
            client.close()
    _progress(f"{image.reference} ready in {time.monotonic() - started:.1f} s")
    return 0


def _size(path: Path) -> str:
    if not path.exists():
        return "absent"
    # du copes with the data root's hard links and special files.
    output = subprocess.run(["du", "-sh", str(path)], capture_output=True, text=True, check=False)
    return output.stdout.split("\t", 1)[0] or "?"


def status(cache: Path) -> int:
    paths = EnginePaths.for_cache(cache)
    pid = running_managed_pid(paths)
    print(f"cache            {cache} ({_size(cache)})")
    print(f"docker data root {paths.data_root} ({_size(paths.data_root)})")
    print(f"dockerd          {'running, pid ' + str(pid) if pid else 'not running'}")
    print(f"kafka recipe     {image_recipe_hash()}")
    for path in sorted((cache / "kafka").glob("*")):
        if path.suffix != ".lock":
            print(f"  {path.name} ({_size(path)})")
    return 0


def clean(cache: Path) -> int:
    paths = EnginePaths.for_cache(cache)
    with file_lock(paths.start_lock), paths.users_lock.open("ab") as users:
        try:
            fcntl.flock(users.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("a test session is using the harness's dockerd; try again after it ends")
            return 1
        if stop_managed_engine(paths):
            _progress("stopped the harness's dockerd")
        remove_tree(cache)
    _progress(f"removed {cache}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness", description=__doc__)
    parser.add_argument("action", choices=["prepare", "status", "clean"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cache = cache_root()
    try:
        if args.action == "prepare":
            return prepare(cache)
        if args.action == "status":
            return status(cache)
        return clean(cache)
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
