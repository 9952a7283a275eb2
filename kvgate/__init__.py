"""kvgate: serve LLMs on Kubernetes from a Kafka queue.

Subsystems are the first level of the package: ``admission_service`` (Kafka in/out and the pure
scheduler), ``gpu_executor`` (models, KV tensors, the step server), ``kernels`` (Triton attention),
``operator`` (kopf handlers for ExecutorPool) and ``telemetry`` (OpenTelemetry names and setup).
"""

__version__ = "0.1.0"
