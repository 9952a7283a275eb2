"""One machine: the embedded broker, the local stack, ``kvgate demo`` and ``kvgate run``.

Local tooling only: the admission service never imports it, and no image but the demo needs it.
"""
