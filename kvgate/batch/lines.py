"""A batch's input line as a Kafka request, and an answer as its output- or error-file line.

A line is read by the gateway's own doors (``kvgate.gateway.doors``): the body of a
``/v1/chat/completions`` line is parsed, checked and mapped exactly as an HTTP request to that
route is, and its answer is rendered by the same door. What is a batch's own:

- the request id is derived (``ids.line_request_id``): a body's ``request_id`` is refused;
- the priority is the batch's (its class); a line may ask to be less important, never more;
- the deadline is the batch's ``expires_at`` (or the line's own, if earlier);
- no streaming; the reply goes to the batch reply partition of the batch's owner.

Output lines are OpenAI's: ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}``. A line the door refused, or the service rejected or failed, goes to
the error file with its HTTP status and OpenAI error body as the response; a line that never
reached the model (not JSON, not a request, another url, cancelled, expired) goes there with
``response: null`` and an ``error`` code (:class:`~kvgate.batch.objects.LineError`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError

from kvgate.admission_service.tokenizer import TextCodec
from kvgate.batch.ids import line_request_id, output_line_id
from kvgate.batch.journal import BatchRecord
from kvgate.batch.jsonl import Line
from kvgate.batch.objects import CustomId, Endpoint, LineError
from kvgate.gateway.doors import CHAT, COMPLETIONS, Body, Door
from kvgate.gateway.openai_api import ApiError, Mapped, bad_field
from kvgate.gateway.responses import result_error
from kvgate.gateway.settings import ModelRoute
from kvgate.protocol.enums import FinishReason
from kvgate.protocol.records import InferenceResult, ReplyTo, ResultStatus

DOORS: dict[Endpoint, Door] = {Endpoint.CHAT: CHAT, Endpoint.COMPLETIONS: COMPLETIONS}


class InputLine(BaseModel):
    """One line of a batch input file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    custom_id: CustomId
    method: str
    url: str
    body: JsonValue


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one input line contributes: a line of the output file or of the error file (or
    neither: a blank line), and the tokens it used. ``reply_offset``: where its answer was read
    in the batch reply partition (None: it had no answer)."""

    index: int
    end_byte: int
    output: bytes | None = None
    error: bytes | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    reply_offset: int | None = None

    @property
    def size_bytes(self) -> int:
        return len(self.output or b"") + len(self.error or b"")


@dataclass(frozen=True, slots=True)
class LineRequest:
    """A line ready to send: its request, and what rendering its answer needs."""

    index: int
    end_byte: int
    custom_id: str
    door: Door
    body: Body
    mapped: Mapped
    route: ModelRoute


def _json_line(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


class LineMapper:
    """Reads one batch's lines and renders its answers (one per batch run)."""

    def __init__(
        self,
        batch: BatchRecord,
        *,
        routes: Mapping[str, ModelRoute],
        codecs: Mapping[str, TextCodec | None],
        default_max_tokens: int,
        reply: ReplyTo,
    ) -> None:
        self.batch = batch
        self.door = DOORS[batch.endpoint]
        self._routes = routes
        self._codecs = codecs
        self._default_max_tokens = default_max_tokens
        self._reply = reply.model_copy(update={"tokens": False})

    # ------------------------------------------------------------------ reading a line
    def read(self, line: Line) -> LineRequest | Outcome:
        """The line's request, or its outcome when it cannot be sent (or is blank)."""
        if line.blank:
            return Outcome(line.index, line.end_byte)
        if line.data is None:
            return self._no_response(line, None, LineError.LINE_TOO_LONG, "the line is too long")
        try:
            raw = json.loads(line.data)
        except (ValueError, UnicodeDecodeError) as exc:
            return self._no_response(line, None, LineError.INVALID_JSON, f"not JSON: {exc}")
        if not isinstance(raw, dict):
            return self._no_response(line, None, LineError.INVALID_JSON, "not a JSON object")
        try:
            parsed = InputLine.model_validate(raw)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error["loc"]) or "line"
            custom_id = raw.get("custom_id") if isinstance(raw.get("custom_id"), str) else None
            message = f"{where}: {error['msg']}"
            return self._no_response(line, custom_id, LineError.INVALID_LINE, message)
        if parsed.method.upper() != "POST":
            return self._no_response(
                line, parsed.custom_id, LineError.INVALID_METHOD, "the method must be POST"
            )
        if parsed.url != self.batch.endpoint.value:
            message = f"the url must be the batch's endpoint, {self.batch.endpoint.value}"
            return self._no_response(line, parsed.custom_id, LineError.INVALID_URL, message)
        try:
            return self._request(line, parsed)
        except ApiError as error:
            return self._http_error(line.index, line.end_byte, parsed.custom_id, error)

    def _request(self, line: Line, parsed: InputLine) -> LineRequest:
        door = self.door
        body = door.parse(parsed.body)
        model = body.model
        route = self._routes.get(model)
        if route is None:
            raise ApiError(
                404, f"the model '{model}' does not exist", param="model", code="model_not_found"
            )
        if getattr(body, "stream", False):
            raise bad_field("stream", "a batch line is not streamed")
        if body.request_id is not None:
            raise bad_field("request_id", "a batch line's request id is its batch's and line's")
        asked = body.priority
        priority = max(self.batch.priority, asked if asked is not None else self.batch.priority)
        request_id = line_request_id(self.batch.id, line.index)
        try:
            mapped = door.map(
                body, request_id=request_id, priority=priority,
                default_max_tokens=self._default_max_tokens, reply=self._reply,
            )  # fmt: skip
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error["loc"]) or "body"
            raise bad_field(where, f"{where}: {error['msg']}") from None
        asked_deadline = mapped.request.deadline_unix_s
        deadline = float(self.batch.expires_at)
        if asked_deadline is None or asked_deadline > deadline:
            request = mapped.request.model_copy(update={"deadline_unix_s": deadline})
            mapped = replace(mapped, request=request)
        return LineRequest(line.index, line.end_byte, parsed.custom_id, door, body, mapped, route)

    # ------------------------------------------------------------------ answers
    def answer(
        self,
        pending: LineRequest,
        result: InferenceResult,
        offset: int,
        aborted: LineError = LineError.CANCELLED,
    ) -> Outcome:
        """The outcome of a sent line from its result (read at ``offset``). Only the batch's
        owner aborts its lines, when it gives the batch up: an aborted line is given up with
        ``aborted`` (cancelled or expired); one the service gave up at its deadline (the
        batch's ``expires_at``) is expired."""
        usage = result.usage
        if result.status is ResultStatus.ABORTED:
            code = LineError.EXPIRED if result.finish_reason is FinishReason.DEADLINE else aborted
            return self.unanswered(pending.index, pending.end_byte, pending.custom_id, code)
        error = result_error(result, chat=pending.door.chat)
        if error is not None:
            outcome = self._http_error(pending.index, pending.end_byte, pending.custom_id, error)
            return replace(
                outcome,
                reply_offset=offset,
                input_tokens=usage.prompt_tokens,
                output_tokens=usage.completion_tokens,
            )
        codec = self._codecs.get(pending.route.name)
        body = pending.door.answer(
            result, pending.body, pending.route.name, int(time.time()), pending.mapped, codec
        )
        output = self._line(pending.index, pending.custom_id, 200, result.request_id, body)
        return Outcome(
            pending.index,
            pending.end_byte,
            output=output,
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            reply_offset=offset,
        )

    def unanswered(
        self, index: int, end_byte: int, custom_id: str | None, code: LineError
    ) -> Outcome:
        """A line the batch gave up on before it was answered (cancelled or expired)."""
        message = {
            LineError.CANCELLED: "the batch was cancelled before this request was answered",
            LineError.EXPIRED: "the request was not answered before the batch expired",
        }.get(code, code.value)
        return Outcome(index, end_byte, error=self._error_line(index, custom_id, code, message))

    # ------------------------------------------------------------------ rendering
    def _no_response(
        self, line: Line, custom_id: str | None, code: LineError, message: str
    ) -> Outcome:
        error = self._error_line(line.index, custom_id, code, message)
        return Outcome(line.index, line.end_byte, error=error)

    def _http_error(self, index: int, end_byte: int, custom_id: str, error: ApiError) -> Outcome:
        request_id = line_request_id(self.batch.id, index)
        line = self._line(index, custom_id, error.status, request_id, error.body())
        return Outcome(index, end_byte, error=line)

    def _line(
        self, index: int, custom_id: str, status: int, request_id: str, body: dict[str, Any]
    ) -> bytes:
        response = {"status_code": status, "request_id": request_id, "body": body}
        return _json_line(
            {
                "id": output_line_id(self.batch.id, index),
                "custom_id": custom_id,
                "response": response,
                "error": None,
            }
        )

    def _error_line(
        self, index: int, custom_id: str | None, code: LineError, message: str
    ) -> bytes:
        return _json_line(
            {
                "id": output_line_id(self.batch.id, index),
                "custom_id": custom_id,
                "response": None,
                "error": {"code": code.value, "message": message},
            }
        )
