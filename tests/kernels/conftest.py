"""Load Triton in the mode these tests need, without changing the backend other tests get.

Triton fixes compiled-vs-interpreted for good when it is first imported (its own
``triton.language`` helpers are ``@jit`` functions decorated at import), from
``TRITON_INTERPRET``. So this conftest, imported before any kernel test module, decides once:

* ``TRITON_INTERPRET`` already set, or no CUDA device: import Triton and kvgate's Triton modules
  with the variable set, then restore the environment. CPU tests run the interpreted kernels by
  setting the variable only for themselves (fixture ``interpreted_triton``), so the rest of the
  session (e.g. the executor's CPU tests) keeps the fast torch path.
* otherwise (a CUDA session): compiled kernels; ``gpu`` tests use them (``compiled_triton``) and
  the interpreter tests skip.

If something imported Triton compiled before this file on a machine without CUDA, the
interpreter tests fail with that explanation rather than silently skipping.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator

import pytest
import torch

from kvgate.kernels.cpu.quant import QuantLoadResult
from kvgate.kernels.dispatch import triton_interpreting

TRITON_MODULES = (
    "kvgate.kernels.triton_attention",
    "kvgate.kernels.triton_cache",
    "kvgate.kernels.triton_moe",
    "kvgate.kernels.triton_quant",
)


def _load_triton() -> bool:
    """Import the Triton modules; return whether their kernels are interpreted."""
    interpret = triton_interpreting() or not torch.cuda.is_available()
    if interpret and "triton" not in sys.modules:
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            for name in TRITON_MODULES:
                importlib.import_module(name)
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
    for name in TRITON_MODULES:
        importlib.import_module(name)
    from triton.runtime.interpreter import InterpretedFunction

    from kvgate.kernels import triton_attention

    return isinstance(triton_attention._paged_attention_kernel, InterpretedFunction)


TRITON_INTERPRETED = _load_triton()


@pytest.fixture
def interpreted_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CPU tensors run the Triton kernels under the interpreter for this test."""
    if not TRITON_INTERPRETED:
        if torch.cuda.is_available():
            pytest.skip("Triton is loaded compiled in this CUDA session; gpu tests cover it")
        pytest.fail(
            "Triton was imported in compiled mode before tests/kernels/conftest.py on a machine "
            "without CUDA, so the kernels cannot be interpreted: run these tests with "
            "TRITON_INTERPRET=1 or keep other test modules from importing triton at collection"
        )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def compiled_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CUDA tensors run the compiled kernels (``gpu`` tests)."""
    if TRITON_INTERPRETED:
        pytest.skip("Triton is loaded in interpreter mode in this session")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield


@pytest.fixture
def torch_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CPU tensors take the vectorized torch path for this test."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield


@pytest.fixture(scope="module")
def compiled_quant() -> QuantLoadResult:
    """The compiled quantized products (``quant.cpp``); skipped with the reason without them."""
    from kvgate.executor.quantized import prepare_quant_kernel

    result = prepare_quant_kernel()
    if not result.compiled:
        pytest.skip(result.log_line())
    return result
