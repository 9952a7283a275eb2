"""The gateway's three generation doors — completions, chat completions and responses — as
data: how each reads a body, maps it to the Kafka request, and answers (a JSON body, or a
stream of chunks). The server runs one sequence of phases for all three (``Gateway._generate``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvgate.admission_service.tokenizer import TextCodec
from kvgate.gateway.openai_api import ChatBody, CompletionBody, Mapped, parse_body, to_request
from kvgate.gateway.responses import chat_body, completion_body
from kvgate.gateway.responses_api import (
    ResponsesBody,
    ResponseStream,
    response_object,
    to_responses_request,
)
from kvgate.gateway.streaming import StreamAssembler
from kvgate.protocol.records import InferenceResult, ReplyTo, TokenChunk
from kvgate.telemetry import attributes as attr


class Streamer(Protocol):
    def opening(self) -> list[dict[str, Any]]: ...

    def token(self, chunk: TokenChunk) -> list[dict[str, Any]]: ...

    def finish(self, result: InferenceResult) -> list[dict[str, Any]]: ...


class Body(Protocol):
    """What the server reads of every door's body (each is a pydantic model)."""

    @property
    def model(self) -> str: ...

    @property
    def priority(self) -> int | None: ...

    @property
    def request_id(self) -> str | None: ...


@dataclass(frozen=True)
class Door:
    name: str
    chat: bool  # messages, not a prompt: a rejection of the prompt names "messages"
    operation: str  # gen_ai.operation.name
    parse: Callable[[object], Body]
    map: Callable[..., Mapped]  # (body, *, request_id, priority, default_max_tokens, reply)
    answer: Callable[[InferenceResult, Body, str, int, Mapped, TextCodec | None], dict[str, Any]]
    streamer: Callable[[Body, Mapped, TextCodec | None, str], Streamer]


def _completions(raw: object) -> Body:
    return parse_body(CompletionBody, raw)


def _chat(raw: object) -> Body:
    return parse_body(ChatBody, raw)


def _responses(raw: object) -> Body:
    return parse_body(ResponsesBody, raw)


def _map_openai(body: Body, **fields: Any) -> Mapped:
    assert isinstance(body, CompletionBody | ChatBody)
    return to_request(body, **fields)


def _map_responses(
    body: Body, *, request_id: str, priority: int, default_max_tokens: int, reply: ReplyTo
) -> Mapped:
    assert isinstance(body, ResponsesBody)
    return to_responses_request(
        body, request_id=request_id, priority=priority, default_max_tokens=default_max_tokens,
        reply=reply,
    )  # fmt: skip


def _responses_answer(
    result: InferenceResult, body: Body, model: str, created: int, mapped: Mapped,
    codec: TextCodec | None,
) -> dict[str, Any]:  # fmt: skip
    assert isinstance(body, ResponsesBody)
    return response_object(result, body, model, created, result.request_id)


def _responses_stream(body: Body, mapped: Mapped, codec: TextCodec | None, model: str) -> Streamer:
    assert isinstance(body, ResponsesBody)
    return ResponseStream(body, mapped, codec, model)


COMPLETIONS = Door(
    name="completions",
    chat=False,
    operation=attr.GEN_AI_OPERATION_TEXT_COMPLETION,
    parse=_completions,
    map=_map_openai,
    answer=lambda result, body, model, created, mapped, codec: completion_body(
        result, model, created, mapped, codec
    ),
    streamer=lambda body, mapped, codec, model: StreamAssembler(mapped, codec, model, chat=False),
)
CHAT = Door(
    name="chat",
    chat=True,
    operation=attr.GEN_AI_OPERATION_CHAT,
    parse=_chat,
    map=_map_openai,
    answer=lambda result, body, model, created, mapped, codec: chat_body(
        result, model, created, mapped, codec
    ),
    streamer=lambda body, mapped, codec, model: StreamAssembler(mapped, codec, model, chat=True),
)
RESPONSES = Door(
    name="responses",
    chat=True,
    operation=attr.GEN_AI_OPERATION_CHAT,
    parse=_responses,
    map=_map_responses,
    answer=_responses_answer,
    streamer=_responses_stream,
)
