"""kvgate's compiled CPU kernels (``ops.cpp``): built once per machine, or not used at all.

:func:`load` compiles ``ops.cpp`` with ``torch.utils.cpp_extension`` into a build directory the
caller names (the executor passes one under the kvgate cache), loads it and registers the
kernels as ``torch.ops.kvgate_cpu.*``; a second process finds the built library and only loads
it (``torch.utils.cpp_extension`` keeps a lock file while it builds, so concurrent processes
wait for one build). Where the machine cannot build it (no C++ compiler, no ninja, a failing
compile), ``load`` says why and every caller keeps the pure-torch path, which computes the same
thing (``TorchLayerOps`` in ``kvgate.executor.layer_ops``, ``torch_ops``, ``torch_attention``).

The library is compiled for this CPU (``-march=native``): the build directory's name carries a
digest of the source, the flags, torch's version and the CPU's feature flags, so a cache shared
with another kind of machine, or another torch, builds its own copy.

Measured (2-core AMD EPYC): a cold build took 15.6 s (load average 2.8) to 36 s (load average
8); a later process loads the built library in 0.3 s.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("ops.cpp")
# -fopenmp: at::parallel_for is an OpenMP region in torch's headers (torch's CPU builds use
# OpenMP); compiled without it, every kernel ran on one thread whatever torch.set_num_threads said.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
# "torch": skip the build and keep the pure-torch kernels; "auto" (or unset): build where possible.
DISABLE_ENV = "KVGATE_CPU_KERNELS"
_CHOICES = ("auto", "torch")


@dataclass(frozen=True)
class LoadResult:
    """Whether the compiled kernels are in use, and a line for the log saying which path runs."""

    compiled: bool
    detail: str

    def log_line(self) -> str:
        if self.compiled:
            return f"CPU kernels: compiled ({self.detail})"
        return f"CPU kernels: pure torch fallback ({self.detail})"


def loaded() -> bool:
    """Whether ``torch.ops.kvgate_cpu`` holds the compiled kernels in this process."""
    return hasattr(torch.ops.kvgate_cpu, "paged_attention")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_name(source: Path = SOURCE, prefix: str = "kvgate_cpu") -> str:
    """The library's name: changes with the source, the flags, torch and the CPU."""
    digest = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), torch.__version__.encode()):
        digest.update(part)
    digest.update(_cpu_flags().encode())
    return f"{prefix}_{digest.hexdigest()[:16]}"


def _ninja_on_path() -> bool:
    """ninja, which ``cpp_extension`` runs: on PATH, or the ``ninja`` wheel's (added to PATH)."""
    if shutil.which("ninja"):
        return True
    try:
        import ninja  # noqa: PLC0415
    except ImportError:
        return False
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    return shutil.which("ninja") is not None


def load(build_root: Path) -> LoadResult:
    """Build (once) and load the kernels under ``build_root``; never raises for a missing tool.

    Safe to call again: an already loaded library is not loaded twice.
    """
    if disabled():
        return LoadResult(False, f"{DISABLE_ENV}=torch")
    if loaded():
        return LoadResult(True, "already loaded")
    return build_library(SOURCE, "kvgate_cpu", build_root)


def disabled() -> bool:
    """Whether ``KVGATE_CPU_KERNELS=torch`` keeps every compiled CPU kernel out."""
    choice = os.environ.get(DISABLE_ENV, "").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{DISABLE_ENV}={choice!r}: expected one of {', '.join(_CHOICES)}")
    return choice == "torch"


def build_library(source: Path, prefix: str, build_root: Path) -> LoadResult:
    """Compile ``source`` (once per machine) under ``build_root`` and load it into torch.ops;
    a LoadResult saying why not where a tool is missing or the compile fails."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return LoadResult(False, f"no C++ compiler ({compiler!r} not on PATH)")
    if not _ninja_on_path():
        return LoadResult(False, "no ninja (neither on PATH nor the ninja package)")
    name = build_name(source, prefix)
    directory = build_root / name
    directory.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension  # noqa: PLC0415  (imports setuptools: only when used)

    try:
        cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_cflags=list(FLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        first = str(error).strip().splitlines()[:1] or [type(error).__name__]
        return LoadResult(False, f"build failed in {directory}: {first[0][:200]}")
    return LoadResult(True, f"{directory}")


__all__ = ["DISABLE_ENV", "LoadResult", "build_library", "build_name", "disabled", "load", "loaded"]
