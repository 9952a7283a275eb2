"""Deterministic simulated executor, workload files and the ``kvgate sim`` command."""
