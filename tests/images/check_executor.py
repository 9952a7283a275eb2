"""Build the executor image on the local Debian base and check it; not part of the test run.

The executor image holds torch with its CUDA libraries (about 6.7 GB, six minutes to build on
the 2-core development machine), too much for every CI run, so this is a command:

    PYTHONPATH=$PWD .venv/bin/python -m tests.images.check_executor [--keep]

It builds ``docker/executor.Dockerfile`` FROM the harness's Debian base (as the admission image
test does), then, under the same lock-down as the pods (no network, read-only root, no
capabilities): imports torch and Triton, runs ``kvgate executor --help``, and checks that gcc
and Python's headers are there for Triton. Without ``--keep`` it removes the image and its
build stage afterwards, giving the disk back. Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import sys

import docker

from tests.harness.docker_engine import docker_engine
from tests.harness.system import cache_root, log_progress
from tests.images.base import ensure_debian_base
from tests.images.conftest import build_image, run_locked_down

TAG = "kvgate-test-executor:latest"
_LARGE_BYTES = 3_000_000_000  # the executor's build stage; nothing else dangling is this big


def _run(client: docker.DockerClient, command: list[str], entrypoint: str | None = None) -> str:
    # torch's import needs more /tmp than the other images' commands.
    return run_locked_down(client, TAG, command, entrypoint=entrypoint, tmp_size="512m")


def check(client: docker.DockerClient) -> list[str]:
    """What is wrong with the built image (empty when nothing)."""
    problems = []
    python = "/opt/kvgate/bin/python"
    versions = _run(client, ["-c", "import torch, triton; print(torch.version.cuda)"], python)
    if not versions.strip():
        problems.append("torch has no CUDA build")
    if "usage: kvgate executor" not in _run(client, ["executor", "--help"]):
        problems.append("kvgate executor --help did not answer")
    toolchain = _run(
        client,
        [
            "-c",
            "import os, shutil, sysconfig; "
            "print(bool(shutil.which('gcc')), "
            "os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))",
        ],
        python,
    )
    if toolchain.split() != ["True", "True"]:
        problems.append(f"Triton's toolchain (gcc, Python.h) is incomplete: {toolchain.strip()}")
    user = client.images.get(TAG).attrs["Config"]["User"]
    if user != "10001:10001":
        problems.append(f"runs as {user!r}")
    return problems


def _remove(client: docker.DockerClient) -> None:
    client.images.remove(TAG)
    for image in client.images.list(filters={"dangling": True}):
        if image.attrs["Size"] > _LARGE_BYTES:
            client.images.remove(image.id)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the image afterwards")
    args = parser.parse_args()
    with docker_engine(cache_root(), print) as engine:
        client = docker.DockerClient(base_url=engine.host, timeout=3600)
        base = ensure_debian_base(client, cache_root(), log_progress)
        built = build_image(client, "executor.Dockerfile", TAG, base, print)
        size_gb = client.images.get(TAG).attrs["Size"] / 1e9
        print(f"built {TAG} in {built.build_s:.0f} s, {size_gb:.1f} GB")
        try:
            problems = check(client)
        finally:
            if not args.keep:
                _remove(client)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    print("executor image: ok" if not problems else "executor image: failed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
