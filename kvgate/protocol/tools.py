"""Tool calling on the wire: the functions a request offers the model, how it must use them, and
the calls it made (in results, and in an assistant message of a conversation).

The shapes are OpenAI's, so the gateway maps them one to one and a Kafka producer writes what an
OpenAI client would send: ``tools`` (functions with a JSON-schema ``parameters``),
``tool_choice`` (``none``, ``auto``, ``required`` or one named function) and
``parallel_tool_calls``. What the service makes of them (the chat template renders the tools;
``required`` and a named function are enforced by the structured-output mask; ``auto`` is parsed
from the model's own format) is ``kvgate.admission_service.tool_calls``.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvgate.protocol.structured import JsonObject

# OpenAI's rule for function names (letters, digits, underscores, dashes; at most 64), plus dots,
# which Hugging Face's tool examples use.
FUNCTION_NAME_PATTERN: Final = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_TOOLS: Final = 128

FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]


class _Input(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


class FunctionDefinition(_Input):
    name: FunctionName
    description: Annotated[str, Field(max_length=100_000)] | None = None
    # The arguments' JSON schema; None: the function takes no arguments (an empty object).
    parameters: JsonObject | None = None
    strict: bool | None = None  # arguments always conform here (the mask enforces the schema)

    def parameters_schema(self) -> JsonObject:
        if self.parameters is None:
            return {"type": "object", "properties": {}}
        return self.parameters


class ToolDefinition(_Input):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceMode(StrEnum):
    NONE = "none"  # the model writes text; the tools are still shown to it
    AUTO = "auto"  # the model decides; calls are parsed from its own format
    REQUIRED = "required"  # at least one call, forced by the mask


class NamedTool(_Input):
    """Call exactly this function (forced by the mask)."""

    name: FunctionName


ToolChoice = ToolChoiceMode | NamedTool


class FunctionCall(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    arguments: str  # a JSON object as text (OpenAI's shape: clients json.loads it)


class ToolCall(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


def tool_call_id(request_id: str, choice: int, index: int) -> str:
    """A call's id: stable for one request, choice and position, so a result rebuilt after a
    crash names its calls the same way."""
    digest = hashlib.blake2b(f"{request_id}\x1f{choice}\x1f{index}".encode(), digest_size=12)
    return f"call_{digest.hexdigest()}"
