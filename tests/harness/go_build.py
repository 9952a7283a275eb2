"""One Go program of the harness, built once per recipe and kept in the cache.

A recipe is a directory holding ``go.mod``, ``go.sum`` and, where the program is the harness's
own, its Go files. :func:`build_recipe` hashes the recipe's files, the Go version and the build
options into ``<cache>/<name>/bin-<hash>/<binary>``; a binary there is always complete (written
under another name, then renamed). Go's module and build caches live under ``<cache>/<name>/go``
(or under another recipe's, ``go_caches``: Go's build cache keys include the module cache path,
so programs of one module family share compiled packages only through one pair of caches),
so that a rebuild after a recipe change compiles only what changed. Builds of one recipe run
under ``<cache>/<name>/build.lock``, so two sessions never build the same thing at once and the
second takes the first one's binary.

``go.sum`` is part of the recipe: builds run with ``-mod=readonly`` and never rewrite it.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.harness.system import HarnessError, Progress, cache_root, file_lock, run_logged

_BUILD_TIMEOUT_S = 3600


class GoMissing(HarnessError):
    """No ``go`` command: nothing Go can be built here (the only reason to skip such a test)."""


def go_command() -> str:
    found = shutil.which("go")
    if found is None:
        raise GoMissing("these tests need Go (https://go.dev/dl/) on PATH to build their servers")
    return found


def go_env(go_caches: Path) -> dict[str, str]:
    """The environment of every harness build: module and build caches under ``go_caches``,
    ``go.sum`` never rewritten (``-mod=readonly``), a module cache that ``rm -rf`` can delete
    with the rest of the harness cache, static binaries."""
    return {
        "GOMODCACHE": str(go_caches / "mod"),
        "GOCACHE": str(go_caches / "build"),
        "GOFLAGS": "-mod=readonly -modcacherw -buildvcs=false",
        "CGO_ENABLED": "0",
    }


@dataclass(frozen=True)
class GoRecipe:
    """What to build: ``package`` (``.`` or an import path) of the module in ``directory``.

    ``files`` are the recipe's files (relative to ``directory``) that the hash covers;
    ``tags``, ``ldflags`` and ``trimpath`` are passed to ``go build`` and covered by the hash
    too. ``go_caches`` names the cache folder whose Go caches the build uses (its own by
    default).
    """

    name: str
    directory: Path
    files: tuple[str, ...]
    package: str
    binary: str
    tags: tuple[str, ...] = ()
    ldflags: str = "-s -w"
    trimpath: bool = True
    go_caches: str = ""

    def hash(self, go_version: str) -> str:
        options = [go_version, self.package, ",".join(self.tags), self.ldflags]
        sha = hashlib.sha256("\0".join([*options, str(self.trimpath)]).encode())
        for name in self.files:
            data = (self.directory / name).read_bytes()
            sha.update(f"\0{name}\0{len(data)}\0".encode())
            sha.update(data)
        return sha.hexdigest()[:12]

    def build_argv(self, go: str, output: Path) -> list[str]:
        argv = [go, "build", *(["-trimpath"] if self.trimpath else []), f"-ldflags={self.ldflags}"]
        if self.tags:
            argv.append(f"-tags={','.join(self.tags)}")
        return [*argv, "-o", str(output), self.package]


def go_version(go: str) -> str:
    completed = subprocess.run(
        [go, "env", "GOVERSION"], capture_output=True, text=True, check=False, timeout=60
    )
    if completed.returncode != 0:
        raise HarnessError(f"`go env GOVERSION` failed: {completed.stderr.strip()}")
    return completed.stdout.strip()


def build_recipe(recipe: GoRecipe, progress: Progress, *, cold_estimate: str) -> Path:
    """The binary of ``recipe``, built on first use (see the module docstring).

    ``cold_estimate`` words how long a build with empty Go caches takes, for the progress line.
    Raises :class:`GoMissing` without Go, and
    :class:`HarnessError` (with the build log's tail) when the build fails.
    """
    go = go_command()
    root = cache_root() / recipe.name
    binary = root / f"bin-{recipe.hash(go_version(go))}" / recipe.binary
    if binary.exists():
        return binary
    with file_lock(root / "build.lock"):
        if binary.exists():  # built by another session while this one waited
            return binary
        log_path = cache_root() / "logs" / f"{recipe.name}-build.log"
        progress(f"building {recipe.name} (go build; {cold_estimate} cold); log: {log_path}")
        started = time.monotonic()
        binary.parent.mkdir(parents=True, exist_ok=True)
        partial = binary.with_name(f"{recipe.binary}.partial")
        run_logged(
            recipe.build_argv(go, partial),
            log_path,
            timeout_s=_BUILD_TIMEOUT_S,
            cwd=recipe.directory,
            env=go_env(cache_root() / (recipe.go_caches or recipe.name) / "go"),
        )
        partial.replace(binary)  # atomic: a binary in the cache is always a complete one
        progress(f"built {recipe.name} in {time.monotonic() - started:.0f} s: {binary}")
    return binary


def recipe_files(directory: Path, extra: Sequence[str] = ()) -> tuple[str, ...]:
    """``go.mod``, ``go.sum`` and every ``.go`` file of ``directory``, plus ``extra``."""
    go_files = sorted(p.name for p in directory.glob("*.go"))
    return ("go.mod", "go.sum", *go_files, *extra)
