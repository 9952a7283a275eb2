"""Reading GGUF files: the configuration, the dequantized weights, the tokenizer metadata.

A GGUF file is one self-describing container: key/value metadata (``{arch}.*`` for the shape,
``tokenizer.*`` for the vocabulary and the chat template) followed by tensors, each in its own
storage type (F32, F16, or a block quantization such as Q8_0 / Q4_1). gguf-py reads the container
and dequantizes the blocks; :mod:`kvgate.executor.gguf_architectures` says what each
architecture's names and metadata mean in the Hugging Face layout the rest of the executor speaks
(tensor names, the RoPE row order of llama files, Gemma's norm offset, the config).

Weights come out two ways. :meth:`GgufFile.tensors` dequantizes every one to a float32 numpy
array (exact for Q4_1/Q8_0: each value is ``d * q (+ m)`` with fp16 ``d`` and ``m``).
:meth:`GgufFile.tensors(keep_quantized=True) <GgufFile.tensors>` keeps the block formats kvgate
multiplies directly (:data:`QUANTIZED_FORMATS`) as they are stored, one uint8 copy of the bytes
(:class:`~kvgate.executor.quantized.QuantizedWeight`); float tensors come out as float32, and a
matrix in any other quantized type is refused by name (``--dtype float32`` dequantizes it).
Undoing the converter's RoPE row order moves quantized rows as bytes: a row is whole blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvgate.executor.checkpoint_error import CheckpointError
from kvgate.executor.gguf_architectures import ARCHITECTURES, architecture_of
from kvgate.executor.gguf_metadata import GgufMetadata
from kvgate.executor.quantized import QuantizedWeight
from kvgate.kernels.quant_formats import QuantFormat

# The metadata type is imported from here by the tokenizer and the tests.
__all__ = [
    "QUANTIZED_FORMATS",
    "SUPPORTED_ARCHITECTURES",
    "GgufFile",
    "GgufMetadata",
    "supported_storage_types",
]

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# Storage types kept as stored by ``tensors(keep_quantized=True)``.
QUANTIZED_FORMATS = tuple(f.value for f in QuantFormat)
_FLOAT_TYPES = ("F32", "F16", "BF16")


def _gguf() -> Any:
    try:
        import gguf  # noqa: PLC0415 — optional: only GGUF models need it
    except ImportError as exc:
        raise CheckpointError(
            "reading .gguf files needs the 'gguf' package (pip install 'kvgate[executor]')"
        ) from exc
    return gguf


def shortest_float32(value: float) -> float:
    """A float32 as the shortest decimal that rounds to it (``1e-06``, not
    ``9.999999974752427e-07``): the value the writer's config most likely said, and the same
    float32 wherever the math rounds to float32."""
    return float(str(np.float32(value)))


def supported_storage_types() -> tuple[str, ...]:
    """Names of the tensor storage types gguf-py can dequantize (F32, F16, BF16, Q8_0, ...)."""
    gguf = _gguf()
    kinds = gguf.GGMLQuantizationType
    dequantizable = {kinds.F32, kinds.F16, *gguf.quants._type_traits}
    return tuple(k.name for k in kinds if k in dequantizable)


class GgufFile:
    """An open GGUF file (memory-mapped by gguf-py); tensors are dequantized on demand."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file {self.path} does not exist")
        gguf = _gguf()
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"{self.path.name} is not a readable GGUF file: {exc}") from exc
        values: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            values[key] = field.contents()
            if field.types == [gguf.GGUFValueType.FLOAT32]:
                values[key] = shortest_float32(values[key])
        self.metadata = GgufMetadata(self.path, values)
        self.architecture = architecture_of(self.metadata)
        self._by_name = {t.name: t for t in self._reader.tensors}
        self._config: dict[str, Any] | None = None

    def hf_config(self) -> dict[str, Any]:
        """The file as the ``config.json`` transformers 5 writes for its model type."""
        if self._config is None:
            names = frozenset(self._by_name)
            config = self.architecture.config(self.metadata, names, self._read)
            # What the weights are once dequantized (a conversion states its own dtype).
            self._config = config | {"dtype": "float32"}
        return dict(self._config)

    def tensors(
        self, keep_quantized: bool = False
    ) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
        """(Hugging Face name, weight in HF orientation) for every weight in the file; RoPE
        tables the config already states are left out. Weights are float32 arrays, or with
        ``keep_quantized`` quantized weights where the file stores a block format."""
        config = self.hf_config()
        arch = self.architecture
        for tensor in self._reader.tensors:
            if tensor.name in arch.rope_tensors:
                continue
            name = arch.hf_name(tensor.name)
            kind = tensor.tensor_type.name
            if not keep_quantized or kind in _FLOAT_TYPES:
                yield name, arch.restore(name, self._dequantize(tensor), config)
                continue
            if kind not in QUANTIZED_FORMATS or len(tensor.shape) != 2:
                raise CheckpointError(
                    f"{self.path.name}: tensor {tensor.name} is stored as {kind}, which kvgate "
                    f"keeps quantized only in {', '.join(QUANTIZED_FORMATS)} matrices; "
                    "--dtype float32 serves the file dequantized"
                )
            # Rows are whole blocks: restoring the RoPE row order moves bytes, never values.
            blocks = arch.restore(name, np.asarray(tensor.data), config)
            cols = int(tensor.shape[0])  # GGUF lists the innermost dimension first
            data = torch.from_numpy(np.array(blocks, dtype=np.uint8, copy=True))
            yield name, QuantizedWeight.of(QuantFormat(kind), data, cols)

    def _read(self, name: str) -> np.ndarray:
        """One tensor by GGUF name, as stored (KeyError when the file has none)."""
        return self._dequantize(self._by_name[name])

    def _dequantize(self, tensor: Any) -> np.ndarray:
        gguf = _gguf()
        kind = tensor.tensor_type
        if kind.name not in supported_storage_types():
            raise CheckpointError(
                f"{self.path.name}: tensor {tensor.name} is stored as {kind.name}, which cannot "
                f"be dequantized (supported: {', '.join(supported_storage_types())})"
            )
        values = gguf.quants.dequantize(tensor.data, kind)
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = np.ascontiguousarray(values.reshape(shape), dtype=np.float32)
        # F32 tensors come back as views of the read-only memory map.
        return values if values.flags.writeable else values.copy()
