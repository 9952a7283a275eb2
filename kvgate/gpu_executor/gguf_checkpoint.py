"""A GGUF file as a checkpoint: served directly, or converted into a Hugging Face directory.

``kvgate executor --model FILE.gguf`` loads through :func:`read_gguf_checkpoint`;
``kvgate convert FILE.gguf OUT_DIR`` writes ``config.json``, ``model.safetensors``,
``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) that transformers and
``kvgate executor --model OUT_DIR`` both load. :func:`cached_conversion` converts once into
``$KVGATE_CACHE/models/<name>-<file digest>-<dtype>/`` (default ``~/.cache/kvgate``), for the
tests and the demo.
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

from kvgate.gpu_executor.config import CheckpointError, ModelConfig, parse_config
from kvgate.gpu_executor.gguf_file import GgufFile
from kvgate.gpu_executor.gguf_tokenizer import SpecialTokens, build_tokenizer
from kvgate.gpu_executor.tensor_parallel.shards import RowRange, ShardPlan
from kvgate.gpu_executor.weights import expected_shapes, pad_vocab_shards

GGUF_SUFFIX = ".gguf"
CACHE_ENV = "KVGATE_CACHE"
# Written last into a converted directory: its presence means the conversion completed.
CONVERTED_MARKER = ".kvgate-converted"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == GGUF_SUFFIX


@dataclass(frozen=True)
class GgufCheckpoint:
    raw_config: dict[str, Any]  # the config.json a conversion writes
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF names, HF orientation
    tokenizer: Tokenizer
    special_tokens: SpecialTokens


def read_gguf_checkpoint(
    path: Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    shard: ShardPlan | None = None,
) -> GgufCheckpoint:
    """Every tensor dequantized to ``dtype`` and checked against the configuration.

    With ``shard``, only this rank's slice of each tensor is kept: tensors are dequantized one at
    a time from the memory-mapped file (a quantized row is stored as whole blocks, so a tensor is
    dequantized whole before it is cut), and never the whole model at once.
    """
    gguf_file = GgufFile(path)
    raw = gguf_file.hf_config()
    config = parse_config(raw)
    if shard is not None:
        shard.check(config)  # before any tensor is dequantized
    tokenizer, specials = build_tokenizer(gguf_file.metadata)
    if tokenizer.get_vocab_size(with_added_tokens=True) > config.vocab_size:
        raise CheckpointError(f"{path.name}: the tokenizer has more tokens than the model")
    shapes = expected_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for name, values in gguf_file.tensors():
        if name not in shapes:
            raise CheckpointError(f"{path.name}: tensor {name} does not fit a llama layout")
        if tuple(values.shape) != shapes[name]:
            raise CheckpointError(
                f"{path.name}: tensor {name} has shape {tuple(values.shape)}, the metadata "
                f"implies {shapes[name]}"
            )
        part = None if shard is None else shard.slice_of(name, config)
        kept = values if part is None else _cut(values, part)
        tensors[name] = torch.from_numpy(kept).to(device=device, dtype=dtype)
    if shard is not None:
        tensors = pad_vocab_shards(tensors, shard, config)
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise CheckpointError(f"{path.name}: missing tensors {', '.join(missing[:8])}")
    return GgufCheckpoint(raw, config, tensors, tokenizer, specials)


def _cut(values: np.ndarray, part: RowRange) -> np.ndarray:
    """A rank's rows or columns of a dequantized tensor, as its own (small) array."""
    if part.dim == 0:
        return np.ascontiguousarray(values[part.start : part.stop])
    return np.ascontiguousarray(values[:, part.start : part.stop])


def convert(path: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Write ``path`` as a Hugging Face directory at ``out_dir`` (created; must not exist)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    if dtype not in _DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    checkpoint = read_gguf_checkpoint(path, _DTYPES[dtype])
    out_dir.mkdir(parents=True, exist_ok=False)
    raw = dict(checkpoint.raw_config, torch_dtype=dtype)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    generation = {k: raw[k] for k in ("bos_token_id", "eos_token_id") if k in raw}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(
        {n: t.contiguous() for n, t in checkpoint.tensors.items()},
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    checkpoint.tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = checkpoint.special_tokens.tokenizer_config()
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out_dir


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
    target = cache_root() / "models" / f"{path.stem}-{file_digest(path)[:16]}-{dtype}"
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
    parser.add_argument("gguf", type=Path, help="a llama-architecture .gguf file")
    parser.add_argument(
        "out_dir", type=Path, nargs="?", help="the directory to write (must not exist)"
    )
    parser.add_argument(
        "--cache",
        action="store_true",
        help=f"convert into ${CACHE_ENV}/models (once) instead; prints the directory",
    )
    parser.add_argument("--dtype", choices=list(_DTYPES), default="float32")


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
            convert(args.gguf, args.out_dir, args.dtype)
            print(f"wrote {args.out_dir}")
    except CheckpointError as exc:
        print(f"kvgate convert: {exc}", file=sys.stderr)
        return 2
    return 0
