"""The wire contracts every part of kvgate shares, and nothing else: pydantic models only.

``step``     the executor step protocol (WebSocket: SessionOpen, StepPlan, StepResult, ...)
``records``  the Kafka records (InferenceRequest, InferenceResult, TokenChunk, DeadLetter, ...)
``admin``    the admission service's admin API bodies (executor membership, drains)

The admission service, the executors, the simulator, the clients and the operator all import
these; none of them owns them.
"""
