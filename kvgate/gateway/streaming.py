"""Server-sent chunks of completions and chat completions, from the token stream and the
result: text deltas, per-token logprobs, every choice of ``n``, and tool calls.

Per choice (its own text decoder, ``StreamText``)::

    token chunk ──▶ text delta (held back while it may begin a stop string, a cut character,
                    or — with tools on auto — a tool call) + that token's logprobs
    result      ──▶ the rest of the text, the tool calls, the finish reason; then usage

Tool calls stream as OpenAI streams them: ``delta.tool_calls[i]`` with the call's id, type and
name first, its arguments after. A named tool choice's output *is* the arguments (the mask
forces them), so they stream as they are generated; a required choice's calls and calls parsed
from the model's own format (auto) are sent whole once the result names them. With tools on
auto, text that could be the start of a call (``{``, ``[``, ``<tool_call>``, ...) is held until
the result says whether it was one. The ids are the result's (``protocol.tools.tool_call_id``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final

from kvgate.admission_service.tokenizer import TextCodec
from kvgate.gateway.detokenize import StreamText
from kvgate.gateway.openai_api import Mapped
from kvgate.gateway.responses import (
    chat_logprob_entries,
    choices_of,
    completion_logprobs,
    finish_reason,
    tool_call_body,
    usage,
)
from kvgate.protocol.records import (
    Choice,
    InferenceResult,
    OutputLogprobs,
    TokenChunk,
    TokenLogprob,
)
from kvgate.protocol.tools import NamedTool, tool_call_id

# How a tool call may begin in the formats the service parses (tool_parsers), as streamed text
# (special tokens such as [TOOL_CALLS] are not in it).
CALL_STARTS: Final = ("<tool_call>", "<|python_tag|>", "{", "[")


@dataclass
class _ChoiceStream:
    text: StreamText
    sent: str = ""  # text sent as content
    held: str = ""  # text received and held back (it may be a tool call)
    calling: bool = False  # a call may have begun: nothing more goes out as content
    arguments_opened: bool = False  # a named call's first delta (id, name) went out
    logprobs_sent: int = 0  # logprob entries sent (one per token, in order)


class StreamAssembler:
    """The chunks of one streamed completion or chat completion."""

    def __init__(self, mapped: Mapped, codec: TextCodec | None, model: str, *, chat: bool) -> None:
        request = mapped.request
        self.mapped = mapped
        self.chat = chat
        self.codec = codec
        self.request_id = request.request_id
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request.request_id}"
        self.model = model
        self.created = int(time.time())
        self.choices = [_ChoiceStream(StreamText(codec, request.stop)) for _ in range(request.n)]
        choice = request.effective_tool_choice
        self.named = choice.name if isinstance(choice, NamedTool) else None

    # ----------------------------------------------------------------------------- chunks
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

    def _choice(
        self,
        index: int,
        *,
        content: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        logprobs: list[OutputLogprobs] | None = None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        if not self.chat:
            body: dict[str, Any] = {
                "index": index,
                "text": content or "",
                "logprobs": completion_logprobs(logprobs) if logprobs else None,
                "finish_reason": finish,
            }
            return self._chunk([body])
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = tool_calls
        entry: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
        entry["logprobs"] = {"content": chat_logprob_entries(logprobs)} if logprobs else None
        return self._chunk([entry])

    def opening(self) -> list[dict[str, Any]]:
        """Chat opens every choice with the assistant's role (as OpenAI and vLLM do); an echoed
        completion with its prompt's text."""
        if not self.chat:
            if not self.mapped.echo:
                return []
            prompt = self.mapped.prompt_text
            request_prompt = self.mapped.request.prompt
            if prompt is None and self.codec is not None and isinstance(request_prompt, list):
                prompt = self.codec.decode(list(request_prompt))
            return [self._choice(i, content=prompt or "") for i in range(len(self.choices))]
        return [
            self._chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for i in range(len(self.choices))
        ]

    def _logprobs_of(self, chunk: TokenChunk) -> list[OutputLogprobs] | None:
        if self.mapped.top_logprobs is None or chunk.logprob is None:
            return None

        def text(token_id: int) -> str | None:
            return self.codec.decode([token_id]) if self.codec is not None else None

        top = chunk.top_logprobs or []
        return [
            OutputLogprobs(
                token_id=chunk.token_id,
                logprob=chunk.logprob,
                token=text(chunk.token_id),
                top=[
                    TokenLogprob(token_id=t.token_id, logprob=t.logprob, token=text(t.token_id))
                    for t in top
                ],
            )
        ]

    # ------------------------------------------------------------------------------ tokens
    def token(self, chunk: TokenChunk) -> list[dict[str, Any]]:
        """The chunks one streamed token makes (often none: text held back)."""
        if chunk.choice >= len(self.choices):
            return []
        stream = self.choices[chunk.choice]
        delta = stream.text.add(chunk.token_id)
        logprobs = self._logprobs_of(chunk)
        if self.mapped.forced_tool:
            return self._forced_delta(chunk.choice, stream, delta)
        if self.mapped.tools_auto:
            delta = self._unless_a_call(stream, delta)
        if not delta and not logprobs:
            return []
        stream.sent += delta
        stream.logprobs_sent += len(logprobs or ())
        return [self._choice(chunk.choice, content=delta, logprobs=logprobs)]

    def _unless_a_call(self, stream: _ChoiceStream, delta: str) -> str:
        """The part of ``delta`` that cannot be a tool call's beginning (the rest is held)."""
        if stream.calling:
            stream.held += delta
            return ""
        text = stream.held + delta
        begun = text.lstrip()
        if not stream.sent and any(
            begun.startswith(s) or s.startswith(begun) for s in CALL_STARTS if begun
        ):
            stream.held = text
            stream.calling = any(begun.startswith(s) for s in CALL_STARTS)
            return ""
        marker = text.find("<tool_call>")
        if marker >= 0:
            stream.calling = True
            stream.held = text[marker:]
            return text[:marker]
        # Hold a tail that may grow into the marker.
        keep = next(
            (k for k in range(min(len(text), 10), 0, -1) if "<tool_call>".startswith(text[-k:])),
            0,
        )
        stream.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _forced_delta(self, index: int, stream: _ChoiceStream, delta: str) -> list[dict[str, Any]]:
        """A named call streams its arguments as they come; a required one is sent whole."""
        if self.named is None or not self.chat:
            stream.held += delta
            return []
        calls: list[dict[str, Any]] = []
        if not stream.arguments_opened:
            stream.arguments_opened = True
            calls.append(
                {"index": 0, "id": tool_call_id(self.request_id, index, 0), "type": "function",
                 "function": {"name": self.named, "arguments": delta}}
            )  # fmt: skip
        elif delta:
            calls.append({"index": 0, "function": {"arguments": delta}})
        stream.sent += delta
        return [self._choice(index, tool_calls=calls)] if calls else []

    # ------------------------------------------------------------------------------ result
    def finish(self, result: InferenceResult) -> list[dict[str, Any]]:
        """The last chunks: each choice's remaining text or its calls, its finish reason,
        then usage when asked for."""
        events: list[dict[str, Any]] = []
        for choice in choices_of(result):
            if choice.index < len(self.choices):
                events += self._finish_choice(choice, self.choices[choice.index])
        if self.mapped.include_usage:
            events.append(self._chunk([], usage=usage(result)))
        return events

    def _finish_choice(self, choice: Choice, stream: _ChoiceStream) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        index = choice.index
        final = choice.text or ""
        if choice.tool_calls and self.chat:
            if self.named is not None and stream.arguments_opened:
                rest = choice.tool_calls[0].function.arguments[len(stream.sent) :]
                if rest:
                    events.append(
                        self._choice(
                            index, tool_calls=[{"index": 0, "function": {"arguments": rest}}]
                        )
                    )
            else:
                if final.startswith(stream.sent) and len(final) > len(stream.sent):
                    events.append(self._choice(index, content=final[len(stream.sent) :]))
                events.append(
                    self._choice(
                        index,
                        tool_calls=[
                            {"index": i, **tool_call_body(call)}
                            for i, call in enumerate(choice.tool_calls)
                        ],
                    )
                )
        else:
            # What the final text holds beyond what was sent (nothing if a decoder was not
            # prefix-stable: the chunks never contradict what went out).
            rest = final[len(stream.sent) :] if final.startswith(stream.sent) else ""
            # The logprobs of tokens whose chunks the result overtook (read from another
            # topic, it may arrive first): every token's entry is sent once, in order.
            unsent = (choice.logprobs or [])[stream.logprobs_sent :]
            if self.mapped.top_logprobs is None:
                unsent = []
            if rest or unsent:
                events.append(self._choice(index, content=rest, logprobs=unsent or None))
                stream.logprobs_sent += len(unsent)
        events.append(self._choice(index, finish=finish_reason(choice.finish_reason)))
        return events
