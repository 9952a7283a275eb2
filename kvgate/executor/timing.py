"""Kernel time inside a step: CUDA events on a GPU, the wall clock on CPU (where ops are
synchronous). Events are read once, after the step's results are on the host."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class KernelTimer:
    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._cpu_s = 0.0

    @contextmanager
    def measure(self) -> Iterator[None]:
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self._cpu_s += time.perf_counter() - began

    def total_s(self) -> float:
        """Seconds measured so far (synchronizes with the last recorded event on a GPU)."""
        if not self._events:
            return self._cpu_s
        self._events[-1][1].synchronize()
        elapsed_ms = sum(float(s.elapsed_time(e)) for s, e in self._events)
        return self._cpu_s + elapsed_ms / 1000.0
