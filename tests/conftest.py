"""Shared pytest configuration: GPU tests are skipped where no CUDA device exists, and tests
marked ``slow`` unless they are selected (``-m slow``, or ``KVGATE_RELIABILITY_FULL=1``; the
reliability tier words its own reason)."""

from __future__ import annotations

import importlib.util
import os

import pytest


def _has_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    full = "slow" in (config.getoption("markexpr") or "")
    full = full or os.environ.get("KVGATE_RELIABILITY_FULL") == "1"
    skip_slow = pytest.mark.skip(reason="slow: select it with -m slow (docs/testing.md)")
    skip_gpu = None if _has_cuda() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if not full and "slow" in item.keywords:
            item.add_marker(skip_slow)
