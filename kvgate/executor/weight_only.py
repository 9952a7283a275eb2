"""Weight-only quantized safetensors checkpoints: AWQ, GPTQ and FP8, as the ``quantization_config``
of their config.json states them.

What is read: the projections of every layer (``q/k/v/o_proj``, ``gate/up/down_proj`` or the
fused ones) stored as the method's tensors in place of ``weight`` (layouts:
:mod:`kvgate.kernels.torch_weight_only`)::

    awq   qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales f16 [K/G, N]
    gptq  qweight int32 [K*bits/32, N], qzeros int32 [K/G, N*bits/32], scales f16 [K/G, N],
          g_idx int32 [K]
    fp8   weight float8_e4m3fn [N, K], weight_scale f32: one per tensor or one per output row

Embeddings, norms, biases and ``lm_head`` are float, as these tools write them; a projection a
config lists in ``modules_to_not_convert`` (AWQ) is float too.

Where they run: under ``--dtype auto``, on a device where Triton's dequantize-in-the-GEMM
kernels (:mod:`kvgate.kernels.triton_quant`) run, every projection stays as stored
(``quantized.PackedSegment``: the weights take the file's memory) and those kernels multiply by
it; elsewhere (CPU, where no kernel reads these layouts) or with a stated dtype, every
projection is dequantized when the checkpoint is read, and the layers run the float weights of
the executor's dtype: the answers of the quantized model, at the float model's memory.
Measured on an H200 (docs/benchmarks.md): the kernels are slower than cuBLAS on the dequantized
bf16 weights, so ``--dtype bfloat16`` trades memory for speed.

What is refused, by name: other methods (compressed-tensors, bitsandbytes, ...), AWQ's GEMV
layout and AWQ without zero points, GPTQ of other widths than 4 and 8 bits or in the v2 format,
a quantized ``lm_head``, FP8 with block scales (``weight_block_size``) or static activation
scales, and quantized mixture-of-experts layers and tensor-parallel loading.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # the config is read by commands that must not import torch (--help)
    import torch


class WeightOnlyMethod(StrEnum):
    AWQ = "awq"
    GPTQ = "gptq"
    FP8 = "fp8"


class WeightOnlyError(ValueError):
    """A quantization_config kvgate cannot serve; the message names the key and its value."""


class WeightOnly(BaseModel):
    """A checkpoint's weight-only quantization (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: WeightOnlyMethod
    bits: Annotated[int, Field(ge=4, le=8)] = 8
    # Input rows per group of scales and zero points; None: one group over all of K.
    group_size: Annotated[int, Field(ge=1)] | None = None
    skipped: tuple[str, ...] = ()  # module names (substrings) left in float

    def quantizes(self, module: str) -> bool:
        return not any(part in module for part in self.skipped)

    def describe(self) -> str:
        if self.method is WeightOnlyMethod.FP8:
            return "FP8 e4m3 weights"
        group = "per channel" if self.group_size is None else f"groups of {self.group_size}"
        return f"{self.method.upper()} {self.bits}-bit weights, {group}"

    def tensor_shapes(self, module: str, rows: int, cols: int) -> dict[str, tuple[int, ...]]:
        """The tensors that hold ``module``'s ``[rows, cols]`` weight (N out, K in). FP8's
        per-tensor scale may also be stored as ``()`` or ``(1,)`` and its per-row scale as
        ``(N, 1)``: :meth:`shape_fits` accepts those."""
        if self.method is WeightOnlyMethod.FP8:
            return {f"{module}.weight": (rows, cols), f"{module}.weight_scale": (rows,)}
        self._check_divides(module, rows, cols)
        groups = 1 if self.group_size is None else cols // self.group_size
        per_int = 32 // self.bits
        if self.method is WeightOnlyMethod.AWQ:
            return {
                f"{module}.qweight": (cols, rows // per_int),
                f"{module}.qzeros": (groups, rows // per_int),
                f"{module}.scales": (groups, rows),
            }
        return {
            f"{module}.qweight": (cols // per_int, rows),
            f"{module}.qzeros": (groups, rows // per_int),
            f"{module}.scales": (groups, rows),
            f"{module}.g_idx": (cols,),
        }

    def shape_fits(self, name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
        if shape == expected:
            return True
        if self.method is WeightOnlyMethod.FP8 and name.endswith(".weight_scale"):
            return shape in ((), (1,), (1, 1), (expected[0], 1))
        return False

    def check_dtype(self, name: str, dtype: torch.dtype) -> None:
        """A stored tensor of the dtype its method writes (a WeightOnlyError naming it if not)."""
        import torch  # noqa: PLC0415  (the config is read without torch: --help)

        suffix = name.rsplit(".", 1)[-1]
        if suffix in ("qweight", "qzeros", "g_idx"):
            allowed: tuple[torch.dtype, ...] = (torch.int32,)
        elif suffix == "weight":  # FP8's
            allowed = (torch.float8_e4m3fn,)
        else:  # scales, weight_scale
            allowed = (torch.float16, torch.bfloat16, torch.float32)
        if dtype not in allowed:
            shown = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise WeightOnlyError(
                f"tensor {name} is {str(dtype).removeprefix('torch.')}; {self.method} stores "
                f"it as {shown}"
            )

    def _check_divides(self, module: str, rows: int, cols: int) -> None:
        per_int = 32 // self.bits
        if rows % per_int or cols % per_int:
            raise WeightOnlyError(
                f"{module} is [{rows}, {cols}]: {self.method} packs {per_int} values per int32, "
                "so both sides must divide by it"
            )
        if self.group_size is not None and cols % self.group_size:
            raise WeightOnlyError(
                f"{module} has {cols} inputs, not a multiple of group_size {self.group_size}"
            )

    def dequantize(
        self, module: str, tensors: Mapping[str, torch.Tensor], rows: int, cols: int
    ) -> torch.Tensor:
        """``module``'s float32 ``[rows, cols]`` weight from its stored tensors."""
        from kvgate.kernels.torch_weight_only import (  # noqa: PLC0415  (torch: on use)
            awq_dequantize,
            fp8_dequantize,
            gptq_dequantize,
        )

        def get(suffix: str) -> torch.Tensor:
            return tensors[f"{module}.{suffix}"]

        if self.method is WeightOnlyMethod.FP8:
            return fp8_dequantize(get("weight"), get("weight_scale"))
        group = self.group_size if self.group_size is not None else cols
        if self.method is WeightOnlyMethod.AWQ:
            return awq_dequantize(get("qweight"), get("qzeros"), get("scales"), group)
        g_idx = get("g_idx")
        self.check_group_index(module, g_idx, get("scales").shape[0])
        return gptq_dequantize(
            get("qweight"), get("qzeros"), get("scales"), g_idx, self.bits, group
        )

    @staticmethod
    def check_group_index(module: str, g_idx: torch.Tensor, groups: int) -> None:
        """GPTQ's ``g_idx`` names only groups the checkpoint has scales for."""
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise WeightOnlyError(f"{module}.g_idx names groups the checkpoint does not have")


def _refuse(key: str, value: Any, served: str) -> WeightOnlyError:
    return WeightOnlyError(
        f"unsupported quantization_config {key}={value!r}: kvgate reads {served}"
    )


def read_weight_only(raw: Mapping[str, Any]) -> WeightOnly | None:
    """The config's ``quantization_config`` (None without one); a WeightOnlyError naming what
    kvgate does not serve."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise WeightOnlyError(f"quantization_config is {type(quant).__name__}, not an object")
    method = quant.get("quant_method")
    if method not in tuple(WeightOnlyMethod):
        raise _refuse("quant_method", method, "awq, gptq and fp8 checkpoints")
    if method == WeightOnlyMethod.FP8:
        if quant.get("weight_block_size") is not None:
            blocks = quant["weight_block_size"]
            raise _refuse("weight_block_size", blocks, "per-tensor and per-row FP8 scales")
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            scheme = quant["activation_scheme"]
            raise _refuse("activation_scheme", scheme, "dynamic (no input scales)")
        if quant.get("fmt", "e4m3") != "e4m3":
            raise _refuse("fmt", quant["fmt"], "e4m3")
        return WeightOnly(method=WeightOnlyMethod.FP8, skipped=_skipped(quant))
    if quant.get("lm_head", False):
        raise _refuse("lm_head", quant.get("lm_head"), "a float lm_head")
    bits = quant.get("bits", quant.get("w_bit"))
    group_size = quant.get("group_size", quant.get("q_group_size"))
    if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
        raise _refuse("group_size", group_size, "a positive group size or -1 (per channel)")
    if method == WeightOnlyMethod.AWQ:
        if bits != 4:
            raise _refuse("bits", bits, "4-bit AWQ")
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse("version", quant.get("version"), "AWQ's GEMM layout")
        if not quant.get("zero_point", True):
            raise _refuse("zero_point", quant.get("zero_point"), "AWQ with zero points")
    else:
        if bits not in (4, 8):
            raise _refuse("bits", bits, "4- and 8-bit GPTQ")
        fmt = quant.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise _refuse("checkpoint_format", fmt, "gptq (v1 zero points)")
    return WeightOnly(
        method=WeightOnlyMethod(method),
        bits=bits,
        group_size=None if group_size == -1 else group_size,
        skipped=_skipped(quant),
    )


def _skipped(quant: Mapping[str, Any]) -> tuple[str, ...]:
    """AWQ's ``modules_to_not_convert`` or AutoFP8's ``ignored_layers``."""
    names = quant.get("modules_to_not_convert") or quant.get("ignored_layers") or ()
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise _refuse("modules_to_not_convert", names, "a list of module names")
    return tuple(names)
