"""The tokenizer an executor serves at ``GET /v1/tokenizer``, so an admission service can
tokenize for the model it drives without holding the model.

The body is the model's ``tokenizer.json`` as text and the chat-relevant part of its
``tokenizer_config.json``. SmolLM2's ``tokenizer.json`` is about 2 MB — over a ConfigMap's 1 MiB
— and only the executor can read the model's volume, so the executor is the one source.
``digest`` names the content: the service accepts executors of one pool only while they agree.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final

from pydantic import BaseModel, ConfigDict

TOKENIZER_PATH: Final = "/v1/tokenizer"
# What a chat needs of tokenizer_config.json; the rest (class names, lengths) is not served.
CHAT_CONFIG_KEYS: Final = ("chat_template", "bos_token", "eos_token")


class TokenizerFiles(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tokenizer_json: str
    tokenizer_config: dict[str, Any] = {}

    @classmethod
    def of(cls, tokenizer_json: str, tokenizer_config: dict[str, Any] | None) -> TokenizerFiles:
        config = tokenizer_config or {}
        return cls(
            tokenizer_json=tokenizer_json,
            tokenizer_config={k: config[k] for k in CHAT_CONFIG_KEYS if k in config},
        )

    @property
    def digest(self) -> str:
        """sha256 of the vocabulary and the chat settings (canonical JSON)."""
        hasher = hashlib.sha256(self.tokenizer_json.encode())
        hasher.update(b"\0")
        hasher.update(json.dumps(self.tokenizer_config, sort_keys=True).encode())
        return hasher.hexdigest()
