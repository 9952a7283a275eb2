"""Tensor parallelism: one executor across the devices of its pod (see ``ranks.py``)."""
