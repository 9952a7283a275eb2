"""kvgate results as OpenAI response bodies (and stream chunks), and result errors as
OpenAI error objects."""

from __future__ import annotations

import time
from typing import Any

from kvgate.gateway.openai_api import ApiError
from kvgate.protocol.enums import FinishReason
from kvgate.protocol.records import (
    InferenceResult,
    OutputLogprobs,
    RejectCode,
    ResultStatus,
    TokenLogprob,
)

# Which request field a rejection is about (the ``param`` of its 400).
_REJECT_PARAM: dict[RejectCode, str] = {
    RejectCode.PROMPT_TOO_LONG: "prompt",
    RejectCode.INFEASIBLE: "max_tokens",
    RejectCode.MAX_TOKENS_TOO_LARGE: "max_tokens",
    RejectCode.PRIORITY_OUT_OF_RANGE: "priority",
    RejectCode.TOKEN_OUT_OF_VOCABULARY: "prompt",
    RejectCode.CHAT_TEMPLATE: "messages",
    RejectCode.TEXT_WITHOUT_TOKENIZER: "prompt",
}


def result_error(result: InferenceResult, *, chat: bool) -> ApiError | None:
    """None for a result that is an answer (completed, or aborted on request)."""
    if result.status is ResultStatus.COMPLETED:
        return None
    if result.status is ResultStatus.REJECTED:
        code = result.reject_code
        param = _REJECT_PARAM.get(code) if code is not None else None
        if chat and param == "prompt":
            param = "messages"
        return ApiError(
            400, result.reason or "rejected", param=param, code=code.value if code else None
        )
    if result.finish_reason is FinishReason.DEADLINE:
        return ApiError(504, "the request's deadline passed", type_="timeout", code="deadline")
    if result.status is ResultStatus.ABORTED:
        return None
    return ApiError(500, result.reason or "the service failed it", type_="server_error")


def finish_reason(result: InferenceResult) -> str:
    return (result.finish_reason or FinishReason.ABORT).value


def usage(result: InferenceResult) -> dict[str, int]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _token_text(entry: OutputLogprobs | TokenLogprob) -> str:
    return entry.token if entry.token is not None else f"token_id:{entry.token_id}"


def completion_logprobs(entries: list[OutputLogprobs]) -> dict[str, Any]:
    tokens = [_token_text(e) for e in entries]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_text(t): t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def _chat_entry(e: OutputLogprobs | TokenLogprob) -> dict[str, Any]:
    text = _token_text(e)
    return {"token": text, "logprob": e.logprob, "bytes": list(text.encode())}


def chat_logprobs(entries: list[OutputLogprobs]) -> dict[str, Any]:
    return {
        "content": [
            {**_chat_entry(e), "top_logprobs": [_chat_entry(t) for t in e.top]} for e in entries
        ]
    }


def completion_body(result: InferenceResult, model: str, created: int) -> dict[str, Any]:
    logprobs = completion_logprobs(result.logprobs) if result.logprobs is not None else None
    return {
        "id": f"cmpl-{result.request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": result.text or "",
                "logprobs": logprobs,
                "finish_reason": finish_reason(result),
            }
        ],
        "usage": usage(result),
    }


def chat_body(result: InferenceResult, model: str, created: int) -> dict[str, Any]:
    logprobs = chat_logprobs(result.logprobs) if result.logprobs is not None else None
    return {
        "id": f"chatcmpl-{result.request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text or ""},
                "logprobs": logprobs,
                "finish_reason": finish_reason(result),
            }
        ],
        "usage": usage(result),
    }


class ChunkMaker:
    """Stream chunks of one request (``text_completion`` or ``chat.completion.chunk``)."""

    def __init__(self, request_id: str, model: str, *, chat: bool) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def first(self) -> dict[str, Any] | None:
        """Chat opens with the assistant's role (as OpenAI and vLLM do)."""
        if not self.chat:
            return None
        return self._chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        )

    def text(self, delta: str, finish: str | None = None) -> dict[str, Any]:
        body: dict[str, Any]
        if self.chat:
            body = {"delta": {"content": delta} if delta or finish is None else {}}
        else:
            body = {"text": delta, "logprobs": None}
        return self._chunk([{"index": 0, **body, "finish_reason": finish}])

    def usage(self, result: InferenceResult) -> dict[str, Any]:
        return self._chunk([], usage=usage(result))
