"""The AVX-512 forms of the compiled CPU attention, on machines without AVX-512.

``ops.cpp`` has AVX-512 forms (head dimensions 64 and 128: the per-token kernel and the tiled
prefill chunks) that a machine without AVX-512 never compiles, so ``test_kernels_cpu.py`` cannot
reach them there. This test rewrites a copy of ``ops.cpp`` onto SIMDe (SIMD Everywhere, header
only: Debian's ``libsimde-dev``), which implements the same intrinsics with the machine's own
vectors, builds it, and runs ``test_kernels_cpu.py``'s attention tests against that build in a
fresh process. It checks the logic (positions, windows, tiles, masks), not the speed, and not
the last bits of a real AVX-512 unit.

Skipped with the reason where the CPU has AVX-512 (the ordinary tests run those forms) or where
SIMDe is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.kernels import cpu

REPO = Path(__file__).resolve().parents[2]
SIMDE_HEADER = Path("/usr/include/simde/x86/avx512.h")

# Intrinsics SIMDe 0.7.4 (Debian 12) lacks, written from their definitions (the additions in
# GCC's tree order; the maximum's order does not matter).
SHIMS = """
static inline float simde_mm512_reduce_add_ps(simde__m512 a) {
  float v[16]; simde_mm512_storeu_ps(v, a);
  float t3[8], t6[4];
  for (int i = 0; i < 8; ++i) t3[i] = v[8 + i] + v[i];
  for (int i = 0; i < 4; ++i) t6[i] = t3[4 + i] + t3[i];
  return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}
static inline float simde_mm512_reduce_max_ps(simde__m512 a) {
  float v[16]; simde_mm512_storeu_ps(v, a);
  float r = v[0];
  for (int i = 1; i < 16; ++i) r = v[i] > r ? v[i] : r;
  return r;
}
static inline void simde_mm512_mask_storeu_ps(void* at, simde__mmask16 k, simde__m512 a) {
  float v[16]; simde_mm512_storeu_ps(v, a);
  for (int i = 0; i < 16; ++i) if ((k >> i) & 1) static_cast<float*>(at)[i] = v[i];
}
static inline simde__m512i simde_mm512_cvttps_epi32(simde__m512 a) {
  float v[16]; simde_mm512_storeu_ps(v, a);
  int32_t r[16];
  for (int i = 0; i < 16; ++i) r[i] = static_cast<int32_t>(v[i]);
  return simde_mm512_loadu_si512(r);
}
static inline simde__m512 simde_mm512_maskz_loadu_ps(simde__mmask16 k, const void* at) {
  float v[16];
  for (int i = 0; i < 16; ++i) v[i] = ((k >> i) & 1) ? static_cast<const float*>(at)[i] : 0.0f;
  return simde_mm512_loadu_ps(v);
}
"""

PLUGIN = """
import torch
from torch.utils import cpp_extension

cpp_extension.load(
    name="kvgate_cpu_avx512_emulated", sources=[{source!r}], extra_cflags={flags!r},
    build_directory={build!r}, is_python_module=False,
)
assert hasattr(torch.ops.kvgate_cpu, "paged_attention")
"""


def _native_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def emulated_source() -> str:
    """``ops.cpp`` with its AVX-512 forms always compiled, on SIMDe's intrinsics."""
    text = cpu.SOURCE.read_text()
    forms = text.count("#if defined(__AVX512F__)")
    assert forms >= 3, "the AVX-512 forms moved: update this rewrite"
    text = text.replace("#if defined(__AVX512F__)", "#if 1").replace("#include <immintrin.h>", "")
    # Intrinsics, vector and mask types, the shuffle macro: SIMDe's names are prefixed.
    text = re.sub(r"\b_mm512_", "simde_mm512_", text)
    text = re.sub(r"\b(__m512i?|__mmask16)\b", r"simde\1", text)
    text = text.replace("_MM_SHUFFLE", "SIMDE_MM_SHUFFLE")
    return "#include <simde/x86/avx512.h>\n" + SHIMS + text


@pytest.mark.skipif(_native_avx512(), reason="AVX-512 here: test_kernels_cpu.py runs those forms")
@pytest.mark.skipif(
    not SIMDE_HEADER.exists(), reason="SIMDe is not installed (apt-get install libsimde-dev)"
)
def test_avx512_attention_forms_match_the_reference(tmp_path: Path) -> None:
    source = tmp_path / "ops_avx512_emulated.cpp"
    source.write_text(emulated_source())
    build = tmp_path / "build"
    build.mkdir()
    plugin = PLUGIN.format(source=str(source), flags=list(cpu.FLAGS), build=str(build))
    (tmp_path / "avx512_emulation.py").write_text(plugin)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-p", "avx512_emulation", "tests/kernels/test_kernels_cpu.py", "-k", "attention",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1:] or [done.stderr[-2000:]]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in summary[0] and "failed" not in summary[0], summary
