"""The OpenAI request bodies the gateway accepts, their errors, and the mapping to kvgate's
``InferenceRequest``.

Every field OpenAI defines, and vLLM's extensions clients use, is either mapped to the record's
field of the same meaning, accepted at a value that changes nothing (a client library's
default), or refused with a 400 that names it; an unknown field is a 400 too
(``extra="forbid"``). docs/gateway.md has the table.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from kvgate.gateway.chat_fields import (
    Message,
    ResponseFormat,
    StructuredOutputsParam,
    ToolChoiceParam,
    ToolParam,
    response_format_record,
    tool_choice_record,
)
from kvgate.protocol.records import (
    MAX_CHOICES,
    REQUEST_ID_PATTERN,
    InferenceRequest,
    ReplyTo,
    RequestSampling,
)
from kvgate.protocol.stopping import DEFAULT_MAX_TOKENS
from kvgate.protocol.structured import StructuredOutput
from kvgate.protocol.tools import NamedTool, ToolChoiceMode


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
    continuous_usage_stats: Literal[False] | None = None  # vLLM's; per-chunk usage is not sent


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]

# Fields accepted only at these values: any other would change behaviour kvgate does not
# implement (a 400 naming the field, with the reason).
MAX_AFFINITY_KEY_CHARS: Final = 256  # InferenceRequest.affinity_key's length limit
_NEUTRAL: Final[dict[str, tuple[tuple[object, ...], str]]] = {
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "functions": ((None,), "functions is deprecated: send tools"),
    "function_call": ((None, "none", "auto"), "function_call is deprecated: send tool_choice"),
    "store": ((None, False), "completions are not stored here (stateless)"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "audio": ((None,), "audio output is not supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "this model does not reason: no reasoning_effort"),
    "web_search_options": ((None,), "web search is not supported"),
    "verbosity": ((None, "medium"), "only the model's own verbosity is supported"),
    "service_tier": ((None, "auto", "default"), "only the default service tier exists here"),
    "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((True,), "only the default decoding is supported"),
    "include_stop_str_in_output": ((False,), "the text always ends before a stop string"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1.0,), "length_penalty applies to beam search, not supported"),
    "return_tokens_as_token_ids": ((False,), "tokens are returned as text"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated here"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported: use logit_bias"),
    "bad_words": ((None, []), "bad_words is not supported: use logit_bias"),
    "guided_whitespace_pattern": ((None,), "JSON whitespace is fixed here"),
    "chat_template": ((None,), "the model's own chat template is used"),
    "chat_template_kwargs": ((None, {}), "chat_template_kwargs is not supported"),
    "continue_final_message": ((False,), "continue_final_message is not supported"),
    "add_generation_prompt": ((True,), "the assistant's turn is always generated"),
    "documents": ((None,), "documents are not supported"),
}


class _Common(_Body):
    model: Annotated[str, Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None  # vLLM's: -1 or 0 means no top-k
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # vLLM's
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: (
        str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None
    ) = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # vLLM's
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's
    min_tokens: Annotated[int, Field(ge=0)] = 0  # vLLM's
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None  # vLLM's
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    priority: int | None = None  # extension: lower is more important; capped per API key
    deadline_unix_s: Annotated[float, Field(gt=0)] | None = None  # extension
    request_id: Annotated[str, Field(pattern=REQUEST_ID_PATTERN)] | None = None  # extension
    metadata: dict[str, str] | None = None  # OpenAI: for stored completions; kept nowhere here
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a placement hint (affinity_key), with user
    # vLLM's structured outputs, new and old names.
    structured_outputs: StructuredOutputsParam | None = None
    guided_json: JsonValue | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # one backend here (llguidance): any name
    guided_whitespace_pattern: str | None = None
    # vLLM's decoding extras, at their defaults only.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    return_tokens_as_token_ids: bool = False
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # vLLM's
    add_special_tokens: bool | None = None  # no special tokens are added to a text prompt

    def check_neutral(self) -> None:
        for name, (neutral, why) in _NEUTRAL.items():
            if name in type(self).model_fields and getattr(self, name) not in neutral:
                raise bad_field(name, f"'{name}' is not supported at this value: {why}")
        if self.top_k is not None and self.top_k < -1:
            raise bad_field("top_k", "top_k must be -1, 0 (no top-k) or positive")

    def affinity_key(self) -> str | None:
        """The record's placement hint: ``prompt_cache_key``, else ``user`` (requests under
        one key share a prompt prefix: the admission service places them together); a value
        longer than the record takes is replaced by its digest."""
        value = self.prompt_cache_key or self.user
        if not value:
            return None
        if len(value) > MAX_AFFINITY_KEY_CHARS:
            return "sha256:" + hashlib.sha256(value.encode()).hexdigest()
        return value

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
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not re.fullmatch(r"[0-9]{1,10}", key):
                raise bad_field("logit_bias", f"logit_bias keys are token ids, not {key!r}")
            bias[int(key)] = value
        return RequestSampling(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=bias,
            min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
        )

    def structured_output(self) -> tuple[str, StructuredOutput] | None:
        """The one structured-output field given, with its name; a 400 when several are."""
        given: list[tuple[str, StructuredOutput]] = []
        try:
            if self.structured_outputs is not None:
                given.append(("structured_outputs", self.structured_outputs.record()))
            if self.guided_json is not None:
                schema = StructuredOutputsParam(json_=self.guided_json).record().json_schema
                given.append(("guided_json", StructuredOutput(json_schema=schema)))
            if self.guided_regex is not None:
                given.append(("guided_regex", StructuredOutput(regex=self.guided_regex)))
            if self.guided_choice is not None:
                given.append(("guided_choice", StructuredOutput(choice=self.guided_choice)))
            if self.guided_grammar is not None:
                given.append(("guided_grammar", StructuredOutput(grammar=self.guided_grammar)))
        except (ValueError, ValidationError) as exc:
            name = given[-1][0] if given else "structured_outputs"
            raise bad_field(name, f"{name}: {_first_message(exc)}") from None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise bad_field(given[1][0], f"give one structured output, not several ({names})")
        return given[0] if given else None


def _first_message(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return str(exc.errors()[0]["msg"])
    return str(exc)


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

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
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    functions: list[JsonValue] | None = None
    function_call: JsonValue | None = None
    modalities: list[str] | None = None
    audio: JsonValue | None = None
    prediction: JsonValue | None = None
    reasoning_effort: str | None = None
    web_search_options: JsonValue | None = None
    verbosity: str | None = None
    echo: bool = False  # vLLM's: the last message's text before the answer; not supported
    chat_template: str | None = None
    chat_template_kwargs: dict[str, JsonValue] | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    documents: list[JsonValue] | None = None

    def check_neutral(self) -> None:
        super().check_neutral()
        if self.echo:
            raise bad_field("echo", "'echo' is not supported on chat completions")
        if self.max_tokens == 0:
            raise bad_field("max_tokens", "max_tokens must be at least 1 for chat")


def checked_request_id(value: str) -> str:
    """A request id from a header, held to the record's rule."""
    if re.fullmatch(REQUEST_ID_PATTERN, value) is None:
        raise bad_field("request_id", f"a request id must match {REQUEST_ID_PATTERN}")
    return value


B = TypeVar("B", bound=BaseModel)


def parse_body(model: type[B], raw: object) -> B:
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
    check = getattr(body, "check_neutral", None)
    if check is not None:
        check()
    return body


@dataclass(frozen=True, slots=True)
class Mapped:
    """A body as its Kafka request, and what answering it in OpenAI's shapes needs."""

    request: InferenceRequest
    top_logprobs: int | None  # None: no logprobs asked for
    stream: bool
    include_usage: bool
    echo: bool = False  # completions: the prompt goes before the completion (and its logprobs)
    prompt_text: str | None = None  # the prompt as the client sent it, when it sent text
    tools_auto: bool = False  # calls may appear in the text (held back while streaming)
    forced_tool: bool = False  # the output is a forced call (arguments, or a list of calls)
    return_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field in the answer


def _chat_fields(body: ChatBody, default_max_tokens: int) -> tuple[dict[str, Any], int]:
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    fields: dict[str, Any] = {"messages": [m.record() for m in body.messages]}
    if body.tools:
        fields["tools"] = [t.record() for t in body.tools]
        choice = tool_choice_record(body.tool_choice)
        names = [t.function.name for t in body.tools]
        if isinstance(choice, NamedTool) and choice.name not in names:
            raise bad_field("tool_choice", f"tool_choice names {choice.name!r}, not a tool")
        if len(set(names)) != len(names):
            raise bad_field("tools", "function names must be unique")
        fields["tool_choice"] = choice
        if body.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = body.parallel_tool_calls
    elif body.tool_choice not in (None, "none"):
        raise bad_field("tool_choice", "tool_choice needs tools")
    structured = response_format_record(body.response_format)
    other = body.structured_output()
    if structured is not None and other is not None:
        raise bad_field(other[0], f"give response_format or {other[0]}, not both")
    structured = structured or (other[1] if other is not None else None)
    if structured is not None:
        fields["structured_output"] = structured
    return fields, max_tokens


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
    echo = False
    prompt_text: str | None = None
    prompt_logprobs = body.prompt_logprobs
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_field("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        fields, max_tokens = _chat_fields(body, default_max_tokens)
    else:
        assert isinstance(body, CompletionBody)
        if body.best_of not in (None, body.n):
            raise bad_field("best_of", "best_of must equal n (no server-side ranking here)")
        max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        logprobs = body.logprobs
        prompt = body.prompt_value()
        fields = {"prompt": prompt}
        structured = body.structured_output()
        if structured is not None:
            fields["structured_output"] = structured[1]
        echo = body.echo
        prompt_text = prompt if isinstance(prompt, str) else None
        if echo and logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = logprobs  # echo with logprobs scores the prompt too
        if max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0  # nothing is generated: the prompt is scored
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if body.stream_options is not None and not body.stream:
        raise bad_field("stream_options", "stream_options needs stream: true")
    request = InferenceRequest(
        request_id=request_id,
        max_tokens=max_tokens,
        stop=body.stops(),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        n=body.n,
        priority=priority,
        sampling=body.sampling(),
        deadline_unix_s=body.deadline_unix_s,
        reply=reply.model_copy(update={"tokens": body.stream}),
        affinity_key=body.affinity_key(),
        **fields,
    )
    choice = request.effective_tool_choice
    return Mapped(
        request,
        logprobs,
        body.stream,
        include_usage,
        echo=echo,
        prompt_text=prompt_text,
        tools_auto=request.tools is not None and choice is ToolChoiceMode.AUTO,
        forced_tool=request.forces_tool_call,
        return_prompt_logprobs=body.prompt_logprobs is not None,
    )
