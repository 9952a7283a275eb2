"""The kernels compile for a real GPU (sm_90) without one: Triton's full pipeline plus ptxas.

The interpreter accepts code the compiler rejects (types of loop-carried values, constexpr
misuse, unsupported ops), and cannot show register spills. This runs
``python -m kvgate.kernels.compile_check --quick`` in a fresh process (compiling needs Triton
loaded in compiled mode, which this test session is not) and requires every variant to compile
without spilling.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

REPO_ROOT = Path(__file__).resolve().parents[2]


def _ptxas_available() -> bool:
    nvidia_bin = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return any(nvidia_bin.glob("ptxas*"))


@pytest.mark.skipif(not _ptxas_available(), reason="this Triton build ships no ptxas")
def test_kernels_compile_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "kvgate.kernels.compile_check", "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=REPO_ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all variants compiled" in result.stdout
    assert result.stdout.count("spills 0 B") == 8, result.stdout
