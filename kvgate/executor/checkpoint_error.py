"""The one error a checkpoint that cannot be served raises (a leaf: the config readers share it).

Import it as ``kvgate.executor.config.CheckpointError``; it lives here only so that the modules
``config`` is built from can raise it without importing ``config``.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A model directory that cannot be served, with the reason in the message."""
