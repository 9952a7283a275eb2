"""OpenAI's file and batch objects, as kvgate keeps and answers them.

The statuses follow OpenAI's batch lifecycle::

    validating ──▶ in_progress ──▶ finalizing ──▶ completed
        │              │ cancel        ▲ (files written)
        │              ├──────────▶ cancelling ──▶ cancelled
        │              │ deadline      (aborts sent, the rest finalized)
        │              └──────────▶ expired       (the same, at expires_at)
        └──▶ failed    (the input file is missing, over the limits, or not a batch file)
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, StringConstraints


class _Object(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL: Final = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)


class Endpoint(StrEnum):
    """The endpoints a batch may name (every line's ``url`` must be the batch's)."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


class FilePurpose(StrEnum):
    BATCH = "batch"  # an input file, uploaded
    BATCH_OUTPUT = "batch_output"  # an output or error file, written by a batch


class LineError(StrEnum):
    """``error.code`` of an error-file line that never reached the model."""

    INVALID_JSON = "invalid_json"  # not a JSON object
    INVALID_LINE = "invalid_request"  # not {custom_id, method, url, body}
    INVALID_URL = "invalid_url"  # a url other than the batch's endpoint
    INVALID_METHOD = "invalid_method"  # not POST
    LINE_TOO_LONG = "line_too_long"  # over max_line_bytes
    CANCELLED = "batch_cancelled"  # not answered before the batch was cancelled
    EXPIRED = "batch_expired"  # not answered before the batch's expires_at


CustomId = Annotated[str, StringConstraints(min_length=1, max_length=512)]
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]


class RequestCounts(_Object):
    """Lines of the input file: all of them, those in the output file, those in the error
    file. ``completed + failed`` reaches ``total`` when the batch finishes, whatever its end."""

    total: int = 0
    completed: int = 0
    failed: int = 0


class Usage(_Object):
    """Tokens of the lines answered so far (OpenAI's ``usage`` of a batch)."""

    input_tokens: int = 0
    output_tokens: int = 0

    def plus(self, input_tokens: int, output_tokens: int) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + input_tokens,
            output_tokens=self.output_tokens + output_tokens,
        )

    def api(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


class BatchError(_Object):
    """Why a batch failed validation (OpenAI's ``errors.data`` entries)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None  # 1-based
