"""kvgate: serve LLMs on Kubernetes from a Kafka queue.

One package per role (``docs/layout.md``): ``protocol`` (the shared wire contracts),
``scheduler`` (the pure core: admission, preemption, restore, prefill; no I/O),
``admission_service`` (Kafka in/out, placement, one scheduler per executor), ``step_server``
(the executor side of the step protocol), ``executor`` (models, KV tensors, the step
runner), ``kernels`` (Triton attention), ``sim`` (the simulated executor and ``kvgate sim``),
``local`` (embedded broker, demo, ``kvgate run``), ``client`` (``produce``/``results``),
``operator`` (kopf handlers for ExecutorPool) and ``telemetry`` (OpenTelemetry names and setup).

``kvgate.__version__`` is the installed distribution's version: pyproject.toml is its one source.
"""

from __future__ import annotations


def __getattr__(name: str) -> str:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

        try:
            return version("kvgate")
        except PackageNotFoundError:  # a source tree on sys.path that was never installed
            return "0+unknown"
    raise AttributeError(f"module 'kvgate' has no attribute {name!r}")
