"""kvgate results as OpenAI response bodies (and the pieces stream chunks share), and result
errors as OpenAI error objects."""

from __future__ import annotations

from typing import Any

from kvgate.admission_service.tokenizer import TextCodec
from kvgate.gateway.openai_api import ApiError, Mapped
from kvgate.protocol.enums import FinishReason
from kvgate.protocol.records import (
    Choice,
    InferenceResult,
    OutputLogprobs,
    PromptLogprob,
    RejectCode,
    ResultStatus,
    TokenLogprob,
)
from kvgate.protocol.tools import ToolCall

# Which request field a rejection is about (the ``param`` of its 400).
_REJECT_PARAM: dict[RejectCode, str] = {
    RejectCode.PROMPT_TOO_LONG: "prompt",
    RejectCode.INFEASIBLE: "max_tokens",
    RejectCode.MAX_TOKENS_TOO_LARGE: "max_tokens",
    RejectCode.PRIORITY_OUT_OF_RANGE: "priority",
    RejectCode.TOKEN_OUT_OF_VOCABULARY: "prompt",
    RejectCode.CHAT_TEMPLATE: "messages",
    RejectCode.TEXT_WITHOUT_TOKENIZER: "prompt",
    RejectCode.STRUCTURED_OUTPUT: "response_format",
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
        if param == "response_format" and result.reason and result.reason.startswith("the forced"):
            param = "tool_choice"
        return ApiError(
            400, result.reason or "rejected", param=param, code=code.value if code else None
        )
    if result.finish_reason is FinishReason.DEADLINE:
        return ApiError(504, "the request's deadline passed", type_="timeout", code="deadline")
    if result.status is ResultStatus.ABORTED:
        return None
    return ApiError(500, result.reason or "the service failed it", type_="server_error")


def finish_reason(reason: FinishReason | None) -> str:
    return (reason or FinishReason.ABORT).value


def usage(result: InferenceResult) -> dict[str, int]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def choices_of(result: InferenceResult) -> list[Choice]:
    """Every choice of a result (one, the top-level fields, when ``n`` is 1)."""
    if result.choices is not None:
        return result.choices
    return [
        Choice(
            index=0,
            finish_reason=result.finish_reason,
            output_token_ids=result.output_token_ids,
            text=result.text,
            logprobs=result.logprobs,
            tool_calls=result.tool_calls,
        )
    ]


def token_text(entry: OutputLogprobs | TokenLogprob | PromptLogprob) -> str:
    return entry.token if entry.token is not None else f"token_id:{entry.token_id}"


def _top(entry: OutputLogprobs | PromptLogprob) -> dict[str, float]:
    return {token_text(t): t.logprob for t in entry.top}


def completion_logprobs(
    entries: list[OutputLogprobs], prompt: list[PromptLogprob] | None = None, start: int = 0
) -> dict[str, Any]:
    """OpenAI's legacy logprobs object: the prompt's tokens first when echoed (the first
    with ``null``), offsets counted from ``start``."""
    tokens: list[str] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for p in prompt or []:
        tokens.append(token_text(p))
        logprobs.append(p.logprob)
        tops.append(_top(p) if p.logprob is not None else None)
    for e in entries:
        tokens.append(token_text(e))
        logprobs.append(e.logprob)
        tops.append(_top(e))
    offsets, at = [], start
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _chat_entry(e: OutputLogprobs | TokenLogprob) -> dict[str, Any]:
    text = token_text(e)
    return {"token": text, "logprob": e.logprob, "bytes": list(text.encode())}


def chat_logprob_entries(entries: list[OutputLogprobs]) -> list[dict[str, Any]]:
    return [{**_chat_entry(e), "top_logprobs": [_chat_entry(t) for t in e.top]} for e in entries]


def chat_logprobs(entries: list[OutputLogprobs]) -> dict[str, Any]:
    return {"content": chat_logprob_entries(entries), "refusal": None}


def vllm_prompt_logprobs(prompt: list[PromptLogprob]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` field: None for the first token, then per position the
    token's and the alternatives' log-probabilities keyed by token id."""
    out: list[dict[str, Any] | None] = []
    for p in prompt:
        if p.logprob is None:
            out.append(None)
            continue
        ranked = {t.token_id: rank for rank, t in enumerate(p.top, start=1)}
        entry = {str(p.token_id): {"logprob": p.logprob, "rank": ranked.get(p.token_id),
                                   "decoded_token": token_text(p)}}  # fmt: skip
        for rank, t in enumerate(p.top, start=1):
            entry.setdefault(
                str(t.token_id),
                {"logprob": t.logprob, "rank": rank, "decoded_token": token_text(t)},
            )
        out.append(entry)
    return out


def echoed_prompt(result: InferenceResult, mapped: Mapped, codec: TextCodec | None) -> str:
    """The prompt's text for ``echo``: as sent, or the token ids' text."""
    if mapped.prompt_text is not None:
        return mapped.prompt_text
    prompt = mapped.request.prompt
    if codec is not None and isinstance(prompt, list):
        return codec.decode(list(prompt))
    return "".join(token_text(p) for p in result.prompt_logprobs or [])


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments},
    }


def completion_body(
    result: InferenceResult, model: str, created: int, mapped: Mapped, codec: TextCodec | None
) -> dict[str, Any]:
    prompt = echoed_prompt(result, mapped, codec) if mapped.echo else ""
    choices = []
    for choice in choices_of(result):
        logprobs = None
        if choice.logprobs is not None:
            echoed = result.prompt_logprobs if mapped.echo and choice.index == 0 else None
            logprobs = completion_logprobs(choice.logprobs, echoed)
        body: dict[str, Any] = {
            "index": choice.index,
            "text": prompt + (choice.text or ""),
            "logprobs": logprobs,
            "finish_reason": finish_reason(choice.finish_reason),
        }
        if mapped.return_prompt_logprobs and result.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(result.prompt_logprobs)
        choices.append(body)
    return {
        "id": f"cmpl-{result.request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(result),
    }


def assistant_message(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": choice.text if choice.tool_calls else (choice.text or ""),
        "refusal": None,
    }
    if choice.tool_calls:
        message["tool_calls"] = [tool_call_body(c) for c in choice.tool_calls]
    return message


def chat_body(
    result: InferenceResult, model: str, created: int, mapped: Mapped, codec: TextCodec | None
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{result.request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": choice.index,
                "message": assistant_message(choice),
                "logprobs": chat_logprobs(choice.logprobs) if choice.logprobs is not None else None,
                "finish_reason": finish_reason(choice.finish_reason),
            }
            for choice in choices_of(result)
        ],
        "usage": usage(result),
    }
