"""``POST /tokenize`` and ``POST /detokenize`` at the server root, as vLLM serves them: a
prompt's or a conversation's token ids (through the model's chat template, tools included),
and token ids' text. They run on the gateway's tokenizer for the model (``--tokenizer``), the
one the admission service tokenizes with, so the counts are the ones a request will have.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from kvgate.admission_service.tokenizer import TextCodec, TokenizerError
from kvgate.gateway.chat_fields import Message, ToolParam, _Body
from kvgate.gateway.openai_api import ApiError, bad_field, parse_body


class TokenizeBody(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    tools: list[ToolParam] | None = None
    add_special_tokens: bool | None = None  # kvgate adds none to a prompt's text
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def tokenize(raw: object, codec: TextCodec) -> dict[str, Any]:
    body = parse_body(TokenizeBody, raw)
    if (body.prompt is None) == (body.messages is None):
        raise bad_field("prompt", "give exactly one of prompt and messages")
    if not body.add_generation_prompt:
        raise bad_field("add_generation_prompt", "the assistant's turn is always rendered")
    try:
        if body.messages is not None:
            tools = [t.record() for t in body.tools] if body.tools else None
            text = codec.render_chat([m.record() for m in body.messages], tools)
        else:
            assert body.prompt is not None
            text = body.prompt
        tokens = codec.encode(text)
    except TokenizerError as exc:
        raise ApiError(503, str(exc), type_="server_error") from None
    except ValueError as exc:  # the chat template refused the conversation
        raise bad_field("messages", str(exc)) from None
    answer: dict[str, Any] = {"count": len(tokens), "max_model_len": None, "tokens": tokens}
    if body.return_token_strs:
        answer["token_strs"] = [codec.decode([t]) for t in tokens]
    return answer


def detokenize(raw: object, codec: TextCodec) -> dict[str, Any]:
    body = parse_body(DetokenizeBody, raw)
    try:
        return {"prompt": codec.decode(list(body.tokens))}
    except (TokenizerError, OverflowError) as exc:
        raise bad_field("tokens", str(exc)) from None
