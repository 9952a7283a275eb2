"""kvgate: serve LLMs on Kubernetes from a Kafka queue.

One package per role (``docs/layout.md``): ``protocol`` (the shared wire contracts),
``admission_service`` (Kafka in/out, placement, and the pure ``scheduler``), ``step_server``
(the executor side of the step protocol), ``gpu_executor`` (models, KV tensors, the step
runner), ``kernels`` (Triton attention), ``sim`` (the simulated executor and ``kvgate sim``),
``local`` (embedded broker, demo, ``kvgate run``), ``client`` (``produce``/``results``),
``operator`` (kopf handlers for ExecutorPool) and ``telemetry`` (OpenTelemetry names and setup).
"""

__version__ = "0.1.0"
