"""The small per-layer operations of the forward: torch expressions, or kvgate's CPU kernels.

``TorchLayerOps`` is the specification (and what runs on CUDA, in half precision, and on a CPU
that cannot build the kernels); ``CompiledLayerOps`` runs the same formulas as single passes
over the data (``kvgate/kernels/cpu/ops.cpp``) on CPU float32 tensors:

| operation | torch (the reference) | compiled, against it |
|---|---|---|
| ``rms_norm`` | five operations | sum of squares in another order: last bits |
| ``add_rms_norm`` | ``residual + x``, then ``rms_norm`` | the sum bit for bit; the norm as above |
| ``silu_and_mul`` | ``F.silu(gate) * up`` | exp by a polynomial (2 ulp): last bits |
| ``rotate_qk`` | ``Rotation.rotate`` (a new tensor) | bit for bit, in place in ``qkv`` |
| ``gelu_tanh_and_mul`` | ``gelu(gate, approximate="tanh") * up`` | (torch on every path) |

:func:`select_layer_ops` picks the compiled ones where they are loaded and the tensors are
CPU float32 (tests/kernels/test_kernels_cpu.py holds the tolerances).
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import torch.nn.functional as F

from kvgate.executor.gguf_checkpoint import cache_root
from kvgate.executor.rope import Rotation
from kvgate.kernels import cpu

log = logging.getLogger("kvgate.executor")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [n, H]`` normalized in fp32, scaled by ``weight [H]`` in the model dtype."""
    x_float = x.float()
    normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class TorchLayerOps:
    """The reference expressions, on any device and dtype."""

    compiled = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + x, rms_norm(residual + x))``, both ``[n, H]``."""
        total = residual + x
        return total, rms_norm(total, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[n, 2 I]`` (gate, then up) -> ``silu(gate) * up [n, I]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[n, 2 I]`` -> ``gelu_tanh(gate) * up [n, I]`` (Gemma's ``gelu_pytorch_tanh``).

        No compiled kernel: torch's CPU GELU is one vectorized pass already, and the MLP's two
        matmuls dwarf it. Measured (Gemma 2 2B's MLP, H 2304, I 9216, packed linears, one
        thread, loaded AMD EPYC): this op is 0.0 %, 1.4 % and 0.8 % of the MLP's time at 1, 32
        and 256 rows; a compiled twin could save part of that and one ``n * I`` temporary.
        """
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rotate_qk(
        self, qkv: torch.Tensor, rotation: Rotation, num_q_heads: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv [n, Hq + 2 Hkv, D]`` -> (q, k rotated, v), each ``[n, heads, D]``."""
        qk = rotation.rotate(qkv[:, : num_q_heads + num_kv_heads])
        q, k = qk.split_with_sizes([num_q_heads, num_kv_heads], dim=1)
        return q, k, qkv[:, num_q_heads + num_kv_heads :]


class CompiledLayerOps(TorchLayerOps):
    """The same operations as ``torch.ops.kvgate_cpu`` kernels (CPU, float32 only)."""

    compiled = True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out: torch.Tensor = torch.ops.kvgate_cpu.rms_norm(x, weight, eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total, normed = torch.ops.kvgate_cpu.add_rms_norm(x, residual, weight, eps)
        return total, normed

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.kvgate_cpu.silu_and_mul(gate_up)
        return out

    def rotate_qk(
        self, qkv: torch.Tensor, rotation: Rotation, num_q_heads: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # qkv is the projection's fresh output: rotating it in place is safe.
        torch.ops.kvgate_cpu.rotary_(
            qkv, rotation.cos[:, 0], rotation.sin_signed[:, 0], num_q_heads + num_kv_heads
        )
        q, k, v = qkv.split_with_sizes([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
        return q, k, v


@cache
def prepare_cpu_kernels() -> cpu.LoadResult:
    """Build (once per machine) and load the CPU kernels; log which path the executor takes."""
    result = cpu.load(cache_root() / "kernels")
    log.info(result.log_line())
    return result


def select_layer_ops(device: torch.device, dtype: torch.dtype) -> TorchLayerOps:
    """Compiled kernels for CPU float32 where they build; the torch expressions otherwise."""
    if device.type == "cpu" and dtype == torch.float32 and prepare_cpu_kernels().compiled:
        return CompiledLayerOps()
    return TorchLayerOps()
