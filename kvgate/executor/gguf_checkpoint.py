"""A GGUF file as a checkpoint: served directly, or converted into a Hugging Face directory.

``kvgate executor --model FILE.gguf`` loads through :func:`read_gguf_checkpoint`;
``kvgate convert FILE.gguf OUT_DIR`` writes ``config.json``, ``model.safetensors``,
``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) that transformers and
``kvgate executor --model OUT_DIR`` both load. :func:`cached_conversion` converts once into
``$KVGATE_CACHE/models/<name>-<file digest>-<dtype>-v<format>/`` (default ``~/.cache/kvgate``),
for the tests and the demo.

Quantized weights stay quantized: ``kvgate executor --model FILE.gguf`` (``--dtype auto``) keeps
the block formats as stored (``read_gguf_checkpoint(keep_quantized=True)``), and
``kvgate convert --dtype quantized`` writes a directory holding the GGUF file itself beside the
config and tokenizer files (no float copy of the weights anywhere); ``--dtype float32``
dequantizes, as every conversion did before.

A conversion is a change of format, not a judgement on serving: every architecture the reader
maps (:mod:`kvgate.executor.gguf_architectures`) converts, checked tensor by tensor against the
config when kvgate's executor runs the model type; when it does not (yet), the directory is still
written for transformers, and ``kvgate convert`` says why the executor would refuse it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from kvgate.executor.config import CheckpointError, ModelConfig, parse_config
from kvgate.executor.gguf_file import SUPPORTED_ARCHITECTURES, GgufFile
from kvgate.executor.gguf_tokenizer import SpecialTokens, build_tokenizer
from kvgate.executor.quantized import QuantizedWeight, Weight, weight_nbytes
from kvgate.executor.tensor_parallel.shards import RowRange, ShardPlan
from kvgate.executor.weights import expected_shapes, pad_vocab_shards

GGUF_SUFFIX = ".gguf"
CACHE_ENV = "KVGATE_CACHE"
# Written last into a converted directory: its presence means the conversion completed.
CONVERTED_MARKER = ".kvgate-converted"
# Part of a cached conversion's name: raise it when a conversion of the same file would differ
# (3: transformers 5's config layout, GGUF architectures beyond llama, new tokenizers,
# float32 metadata in its shortest decimal form).
CONVERSION_FORMAT = 3
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# ``--dtype quantized``: a directory that keeps the GGUF blocks (the file itself, inside).
QUANTIZED = "quantized"
GGUF_IN_DIRECTORY = "model.gguf"


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == GGUF_SUFFIX


@dataclass(frozen=True)
class GgufCheckpoint:
    raw_config: dict[str, Any]  # the config.json a conversion writes
    config: ModelConfig
    tensors: dict[str, Weight]  # HF names, HF orientation
    tokenizer: Tokenizer
    special_tokens: SpecialTokens

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take in memory (each tensor once)."""
        return sum(weight_nbytes(t) for t in self.tensors.values())

    @property
    def quantized(self) -> bool:
        """Whether any weight is kept in its block format."""
        return any(isinstance(t, QuantizedWeight) for t in self.tensors.values())


def read_gguf_checkpoint(
    path: Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    shard: ShardPlan | None = None,
    *,
    keep_quantized: bool = False,
) -> GgufCheckpoint:
    """Every tensor dequantized to ``dtype`` (or, with ``keep_quantized``, the block formats
    kept as stored and float tensors in ``dtype``) and checked against the configuration.

    ``keep_quantized`` is a preference: a sharded read and a mixture-of-experts model dequantize
    all the same (tensor-parallel linears and experts run float weights only);
    :attr:`GgufCheckpoint.quantized` says what was read.

    With ``shard``, only this rank's slice of each tensor is kept: tensors are dequantized one at
    a time from the memory-mapped file (a quantized row is stored as whole blocks, so a tensor is
    dequantized whole before it is cut), and never the whole model at once.
    """
    gguf_file = GgufFile(path)
    raw = gguf_file.hf_config()
    config = parse_config(raw)
    if shard is not None:
        shard.check(config)  # before any tensor is dequantized
    keep_quantized = keep_quantized and shard is None and config.moe is None
    tokenizer, specials = _tokenizer(gguf_file, config.vocab_size)
    tensors = _checked_tensors(gguf_file, config, dtype, device, shard, keep_quantized)
    return GgufCheckpoint(raw, config, tensors, tokenizer, specials)


def _tokenizer(gguf_file: GgufFile, vocab_size: int) -> tuple[Tokenizer, SpecialTokens]:
    tokenizer, specials = build_tokenizer(gguf_file.metadata)
    if tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise CheckpointError(
            f"{gguf_file.path.name}: the tokenizer has more tokens than the model"
        )
    return tokenizer, specials


def _checked_tensors(
    gguf_file: GgufFile,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | None,
    shard: ShardPlan | None,
    keep_quantized: bool = False,
) -> dict[str, Weight]:
    name_of_file = gguf_file.path.name
    shapes = expected_shapes(config)
    tensors: dict[str, Weight] = {}
    for name, values in gguf_file.tensors(keep_quantized):
        if name not in shapes:
            raise CheckpointError(
                f"{name_of_file}: tensor {name} does not fit a {config.model_type} layout"
            )
        if tuple(values.shape) != shapes[name]:
            raise CheckpointError(
                f"{name_of_file}: tensor {name} has shape {tuple(values.shape)}, the metadata "
                f"implies {shapes[name]}"
            )
        if isinstance(values, QuantizedWeight):
            tensors[name] = values if device is None else values.to(device)
            continue
        part = None if shard is None else shard.slice_of(name, config)
        kept = values if part is None else _cut(values, part)
        tensors[name] = torch.from_numpy(kept).to(device=device, dtype=dtype)
    if shard is not None:
        dense = {n: t for n, t in tensors.items() if isinstance(t, torch.Tensor)}
        tensors = dict(pad_vocab_shards(dense, shard, config))
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise CheckpointError(f"{name_of_file}: missing tensors {', '.join(missing[:8])}")
    return tensors


def _dense(values: np.ndarray | QuantizedWeight) -> np.ndarray:
    if isinstance(values, QuantizedWeight):  # only tensors(keep_quantized=True) yields these
        raise TypeError("a dequantizing read returned a quantized weight")
    return values


def _cut(values: np.ndarray, part: RowRange) -> np.ndarray:
    """A rank's rows or columns of a dequantized tensor, as its own (small) array."""
    if part.dim == 0:
        return np.ascontiguousarray(values[part.start : part.stop])
    return np.ascontiguousarray(values[:, part.start : part.stop])


@dataclass(frozen=True)
class Conversion:
    """What :func:`convert` wrote, and why the executor would refuse it (None: it serves it)."""

    out_dir: Path
    executor_refusal: str | None


def convert(path: Path, out_dir: Path, dtype: str = "float32") -> Conversion:
    """Write ``path`` as a Hugging Face directory at ``out_dir`` (created; must not exist).

    ``dtype`` ``quantized`` keeps the blocks: the directory holds the configuration, the
    tokenizer files and a copy of the GGUF file itself as ``model.gguf``, which
    ``kvgate executor --model DIR`` serves quantized (transformers reads such a directory with
    ``gguf_file="model.gguf"``).
    """
    if dtype != QUANTIZED and dtype not in _DTYPES:
        choices = ", ".join([*_DTYPES, QUANTIZED])
        raise CheckpointError(f"dtype {dtype!r} is not one of {choices}")
    gguf_file = GgufFile(path)
    raw = gguf_file.hf_config()
    try:
        config: ModelConfig | None = parse_config(raw)
        refusal = None
    except CheckpointError as exc:
        config, refusal = None, str(exc)
    tokenizer, specials = _tokenizer(gguf_file, int(raw["vocab_size"]))
    if dtype == QUANTIZED:
        if config is not None:  # every tensor checked (and kept quantized) before writing
            _checked_tensors(gguf_file, config, torch.float32, None, None, keep_quantized=True)
        out_dir.mkdir(parents=True, exist_ok=False)
        shutil.copyfile(path, out_dir / GGUF_IN_DIRECTORY)
    else:
        _write_safetensors(gguf_file, config, _DTYPES[dtype], out_dir)
    raw = dict(raw, dtype="float32" if dtype == QUANTIZED else dtype)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    generation = {k: raw[k] for k in ("bos_token_id", "eos_token_id") if k in raw}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = specials.tokenizer_config()
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return Conversion(out_dir, refusal)


def _write_safetensors(
    gguf_file: GgufFile, config: ModelConfig | None, dtype: torch.dtype, out_dir: Path
) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415

    if config is not None:
        checked = _checked_tensors(gguf_file, config, dtype, None, None)
        tensors = {n: t for n, t in checked.items() if isinstance(t, torch.Tensor)}
    else:  # transformers checks the shapes when it loads the directory
        tensors = {n: torch.from_numpy(_dense(v)).to(dtype) for n, v in gguf_file.tensors()}
    out_dir.mkdir(parents=True, exist_ok=False)
    save_file(
        {n: t.contiguous() for n, t in tensors.items()},
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvgate")


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cached_conversion(path: Path, dtype: str = "float32") -> Path:
    """The converted directory of ``path`` in the cache, converting on first use.

    The conversion runs into a temporary sibling and is renamed into place, so a crash or a
    concurrent conversion never leaves a half-written directory under the final name.
    """
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    name = f"{path.stem}-{file_digest(path)[:16]}-{dtype}-v{CONVERSION_FORMAT}"
    target = cache_root() / "models" / name
    if (target / CONVERTED_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert(path, scratch / "model", dtype)
        (scratch / "model" / CONVERTED_MARKER).write_text(str(path) + "\n")
        try:
            (scratch / "model").rename(target)
        except OSError:
            if not (target / CONVERTED_MARKER).is_file():
                raise  # not a concurrent conversion that won the race
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "gguf", type=Path, help=f"a .gguf file ({', '.join(SUPPORTED_ARCHITECTURES)})"
    )
    parser.add_argument(
        "out_dir", type=Path, nargs="?", help="the directory to write (must not exist)"
    )
    parser.add_argument(
        "--cache",
        action="store_true",
        help=f"convert into ${CACHE_ENV}/models (once) instead; prints the directory",
    )
    parser.add_argument(
        "--dtype",
        choices=[*_DTYPES, QUANTIZED],
        default="float32",
        help=f"the weights' type; {QUANTIZED}: kept in the file's block formats (the directory "
        f"holds the GGUF file as {GGUF_IN_DIRECTORY})",
    )


def run(args: argparse.Namespace) -> int:
    """``kvgate convert MODEL.gguf OUT_DIR`` or ``kvgate convert MODEL.gguf --cache``."""
    if (args.out_dir is None) != args.cache:
        print("kvgate convert: give OUT_DIR or --cache (one of them)", file=sys.stderr)
        return 2
    if args.out_dir is not None and args.out_dir.exists():
        print(f"kvgate convert: {args.out_dir} already exists", file=sys.stderr)
        return 2
    try:
        if args.cache:
            print(cached_conversion(args.gguf, args.dtype))
        else:
            conversion = convert(args.gguf, args.out_dir, args.dtype)
            print(f"wrote {conversion.out_dir}")
            if conversion.executor_refusal is not None:
                print(
                    "note: transformers loads it; kvgate's executor does not serve it yet: "
                    f"{conversion.executor_refusal}",
                    file=sys.stderr,
                )
    except CheckpointError as exc:
        print(f"kvgate convert: {exc}", file=sys.stderr)
        return 2
    return 0
