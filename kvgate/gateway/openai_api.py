"""The OpenAI request bodies the gateway accepts, their errors, and the mapping to kvgate's
``InferenceRequest``.

Every field OpenAI defines is either mapped or refused with a 400 that names it (an unknown
field too: ``extra="forbid"``); kvgate's own extensions are ``top_k``, ``ignore_eos``,
``priority``, ``deadline_unix_s`` and ``request_id`` (docs/gateway.md has the table).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvgate.protocol.records import (
    REQUEST_ID_PATTERN,
    ChatMessage,
    InferenceRequest,
    ReplyTo,
    RequestSampling,
)


class ApiError(Exception):
    """An OpenAI error object with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_field(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


# Fields OpenAI defines that kvgate does not implement: accepted only at their neutral value.
_NEUTRAL: dict[str, object] = {
    "echo": False,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "suffix": None,
    "best_of": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "response_format": None,
    "parallel_tool_calls": None,
    "service_tier": None,
    "store": None,
    "metadata": None,
    "modalities": None,
    "audio": None,
    "prediction": None,
    "reasoning_effort": None,
}


class _Common(_Body):
    model: Annotated[str, Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None  # extension (vLLM's): -1 or 0 means no top-k
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: (
        str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None
    ) = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension (vLLM's)
    priority: int | None = None  # extension: lower is more important; capped per API key
    deadline_unix_s: Annotated[float, Field(gt=0)] | None = None  # extension
    request_id: Annotated[str, Field(pattern=REQUEST_ID_PATTERN)] | None = None  # extension
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

    def check_neutral(self) -> None:
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name, neutral)
            if value is None or value == neutral or value in ({}, []):
                continue
            raise bad_field(name, f"'{name}' is not supported by this server")
        if self.n != 1:
            raise bad_field("n", "only n=1 is supported (send n requests instead)")
        if self.top_k is not None and self.top_k < -1:
            raise bad_field("top_k", "top_k must be -1, 0 (no top-k) or positive")

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            if not self.stop:
                raise bad_field("stop", "a stop string must not be empty")
            return [self.stop]
        return list(self.stop)

    def sampling(self) -> RequestSampling:
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else None
        return RequestSampling(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    suffix: str | None = None

    def prompt_value(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_field("prompt", "only one prompt per request is supported")
            prompt = prompt[0]
        if not prompt:
            raise bad_field("prompt", "the prompt must not be empty")
        return prompt  # type: ignore[return-value]


class ChatBody(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None


def checked_request_id(value: str) -> str:
    """A request id from a header, held to the record's rule."""
    if re.fullmatch(REQUEST_ID_PATTERN, value) is None:
        raise bad_field("request_id", f"a request id must match {REQUEST_ID_PATTERN}")
    return value


def parse_body(model: type[_Common], raw: object) -> _Common:
    """A request body or a 400 naming the first bad field."""
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        body = model.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "body"
        top = str(error["loc"][0]) if error["loc"] else None
        if error["type"] == "extra_forbidden":
            raise bad_field(where, f"unsupported field '{where}'") from None
        raise bad_field(top or where, f"{where}: {error['msg']}") from None
    body.check_neutral()
    return body


@dataclass(frozen=True, slots=True)
class Mapped:
    request: InferenceRequest
    top_logprobs: int | None  # None: no logprobs asked for
    stream: bool
    include_usage: bool


def to_request(
    body: _Common,
    *,
    request_id: str,
    priority: int,
    default_max_tokens: int,
    reply: ReplyTo,
) -> Mapped:
    """The Kafka request a body stands for (its reply address set; tokens only when streamed)."""
    logprobs: int | None
    if isinstance(body, ChatBody):
        max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_field("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt: dict[str, Any] = {
            "messages": [ChatMessage(role=m.role, content=m.text()) for m in body.messages]
        }
    else:
        assert isinstance(body, CompletionBody)
        max_tokens = body.max_tokens or 16  # OpenAI's default for completions
        logprobs = body.logprobs
        prompt = {"prompt": body.prompt_value()}
    if body.stream and logprobs is not None:
        raise bad_field("logprobs", "logprobs are not available with stream: true")
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if body.stream_options is not None and not body.stream:
        raise bad_field("stream_options", "stream_options needs stream: true")
    request = InferenceRequest(
        request_id=request_id,
        max_tokens=max_tokens,
        stop=body.stops(),
        logprobs=logprobs,
        priority=priority,
        sampling=body.sampling(),
        deadline_unix_s=body.deadline_unix_s,
        reply=reply.model_copy(update={"tokens": body.stream}),
        **prompt,
    )
    return Mapped(request, logprobs, body.stream, include_usage)
