"""A GGUF file's key/value metadata, with typed reads that name the key when it is wrong."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.executor.checkpoint_error import CheckpointError


@dataclass(frozen=True)
class GgufMetadata:
    """The metadata of one file: plain values by key (arrays as lists)."""

    path: Path
    values: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.values:
            raise CheckpointError(f"{self.path.name}: metadata key {key} is missing")
        return self.values[key]

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def arch_key(self, name: str) -> str:
        """``attention.head_count`` → ``qwen3.attention.head_count``."""
        return f"{self.architecture}.{name}"

    def arch_int(self, name: str, default: int | None = None) -> int:
        """An integer ``{arch}.name``; required when ``default`` is None."""
        key = self.arch_key(name)
        value = self.require(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{self.path.name}: {key} must be an integer, got {value!r}")
        return value

    def arch_float(self, name: str, default: float | None = None) -> float:
        """A number ``{arch}.name``; required when ``default`` is None."""
        key = self.arch_key(name)
        value = self.require(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckpointError(f"{self.path.name}: {key} must be a number, got {value!r}")
        return float(value)

    def arch_optional(self, name: str) -> Any:
        return self.get(self.arch_key(name))
