"""The executor side of the step protocol: ``kvgate executor`` and ``kvgate sim-executor`` share it.

Torch-free: bearer auth, the session handshake and epoch fencing
(:mod:`kvgate.protocol.session`), in-order plans on one worker thread, health, readiness and
metrics. An executor plugs in as a :class:`~kvgate.step_server.server.StepBackend`.
"""
