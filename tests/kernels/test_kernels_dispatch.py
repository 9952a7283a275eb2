"""The dispatch rule: CUDA -> Triton, CPU + TRITON_INTERPRET -> Triton interpreted, CPU -> torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from kvgate import kernels
from kvgate.kernels import triton_attention, triton_cache
from kvgate.kernels.dispatch import Backend, select_backend
from kvgate.kernels.triton_common import require_matching_triton_mode
from tests.kernels.paged_cases import Row, build_batch


@pytest.mark.parametrize(
    ("device", "interpret", "expected"),
    [
        ("cuda", None, Backend.TRITON),
        ("cuda", "1", Backend.TRITON),
        ("cpu", None, Backend.TORCH),
        ("cpu", "0", Backend.TORCH),
        ("cpu", "1", Backend.TRITON),
        ("cpu", "true", Backend.TRITON),
    ],
)
def test_select_backend(
    monkeypatch: pytest.MonkeyPatch, device: str, interpret: str | None, expected: Backend
) -> None:
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert select_backend(torch.device(device)) is expected


def test_select_backend_rejects_other_devices() -> None:
    with pytest.raises(ValueError, match="CUDA or CPU"):
        select_backend(torch.device("meta"))


class Spy:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        self.calls += 1
        return torch.zeros(0)


@pytest.mark.parametrize("interpret", [False, True])
def test_public_functions_follow_the_rule(monkeypatch: pytest.MonkeyPatch, interpret: bool) -> None:
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spies = {name: Spy() for name in ("attn_torch", "attn_triton", "write_torch", "write_triton")}
    monkeypatch.setattr(kernels, "paged_attention_torch", spies["attn_torch"])
    monkeypatch.setattr(triton_attention, "paged_attention_triton", spies["attn_triton"])
    monkeypatch.setattr(kernels, "write_kv_torch", spies["write_torch"])
    monkeypatch.setattr(triton_cache, "write_kv_triton", spies["write_triton"])
    batch = build_batch([Row(1, 3)], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    kernels.paged_attention(*batch.args(), 1.0)
    kv = torch.zeros(1, 1, 64)
    kernels.write_kv(kv, kv, batch.key_cache, batch.value_cache, torch.tensor([0]))
    chosen = "triton" if interpret else "torch"
    other = "torch" if interpret else "triton"
    assert spies[f"attn_{chosen}"].calls == 1 and spies[f"write_{chosen}"].calls == 1
    assert spies[f"attn_{other}"].calls == 0 and spies[f"write_{other}"].calls == 0


def test_mode_mismatch_is_a_clear_error() -> None:
    def kernel() -> None: ...

    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1 before the first"):
        require_matching_triton_mode(object(), torch.device("cpu"))  # a compiled kernel
    with pytest.raises(RuntimeError, match="unset TRITON_INTERPRET"):
        require_matching_triton_mode(InterpretedFunction(kernel), torch.device("cuda"))
    require_matching_triton_mode(InterpretedFunction(kernel), torch.device("cpu"))


def test_package_import_does_not_load_triton() -> None:
    """Importing kvgate.kernels must not fix Triton's mode (nor cost Triton's import time)."""
    code = "import sys, kvgate.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, result.stderr
