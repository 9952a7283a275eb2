"""Tool calls in a model's own words: one small parser per format, chosen by the model's chat
template (or the service's ``limits.tool_call_parser``).

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (Hermes, Qwen 2.5/3;
                  also what kvgate's own tool prompt asks a template without tools for)
    llama3_json   {"name": ..., "parameters": {...}}, calls separated by ";", optionally after
                  <|python_tag|> (Llama 3.1/3.2 JSON tool calling)
    mistral       [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  or, in newer templates,
                  [TOOL_CALLS]name[ARGS]{...} per call

Each parser reads the output decoded *with* its special tokens (``[TOOL_CALLS]`` and
``<|python_tag|>`` are special tokens a plain decode drops) and returns the calls and the text
besides them. Output that names no known function, or whose arguments are not a JSON object, is
not a call: it stays text, as vLLM's parsers leave it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from pydantic import JsonValue


class ToolCallFormat(StrEnum):
    AUTO = "auto"  # chosen from the chat template
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


HERMES_OPEN: Final = "<tool_call>"
HERMES_CLOSE: Final = "</tool_call>"
PYTHON_TAG: Final = "<|python_tag|>"
MISTRAL_CALLS: Final = "[TOOL_CALLS]"
MISTRAL_ARGS: Final = "[ARGS]"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object as compact text


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None  # the text besides the calls (None when there is none)
    calls: tuple[ParsedCall, ...]


def detect_format(template_source: str | None) -> ToolCallFormat:
    """The format a chat template asks its model for; Hermes when it says nothing (kvgate's
    own tool prompt then asks for it)."""
    source = template_source or ""
    if MISTRAL_CALLS in source:
        return ToolCallFormat.MISTRAL
    if PYTHON_TAG in source or "ipython" in source:
        return ToolCallFormat.LLAMA3_JSON
    return ToolCallFormat.HERMES


def call_of(raw: object, names: frozenset[str], *arguments_keys: str) -> ParsedCall | None:
    """``{"name": known, "<arguments key>": {...}}`` as a call, else None."""
    if not isinstance(raw, dict) or raw.get("name") not in names:
        return None
    for key in arguments_keys:
        if key in raw:
            arguments = raw[key]
            if isinstance(arguments, str):  # some models write the object as a string
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    return None
            if not isinstance(arguments, dict):
                return None
            return ParsedCall(str(raw["name"]), compact(arguments))
    return ParsedCall(str(raw["name"]), "{}")


def compact(value: JsonValue) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _content(text: str) -> str | None:
    stripped = text.strip()
    return stripped or None


def parse_hermes(text: str, names: frozenset[str]) -> ParsedOutput:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return ParsedOutput(_content(text), ())
    calls = []
    for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[start:], flags=re.DOTALL):
        call = call_of(_loads(body.strip()), names, "arguments", "parameters")
        if call is None:
            return ParsedOutput(_content(text), ())
        calls.append(call)
    return ParsedOutput(_content(text[:start]), tuple(calls))


def parse_llama3_json(text: str, names: frozenset[str]) -> ParsedOutput:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return ParsedOutput(_content(text), ())
    calls = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(body):
        try:
            raw, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return ParsedOutput(_content(text), ())
        call = call_of(raw, names, "parameters", "arguments")
        if call is None:
            return ParsedOutput(_content(text), ())
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return ParsedOutput(None, tuple(calls))


def parse_mistral(text: str, names: frozenset[str]) -> ParsedOutput:
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        return ParsedOutput(_content(text), ())
    calls: list[ParsedCall] = []
    for piece in text[start:].split(MISTRAL_CALLS)[1:]:
        part = piece.strip()
        if MISTRAL_ARGS in part:  # name[ARGS]{...}
            name, _, arguments = part.partition(MISTRAL_ARGS)
            call = call_of(
                {"name": name.strip(), "arguments": _loads(arguments)}, names, "arguments"
            )
            found = [call] if call is not None else None
        else:  # [{"name": ..., "arguments": {...}}, ...]
            raw = _loads(part)
            items = raw if isinstance(raw, list) else [raw]
            parsed = [call_of(item, names, "arguments", "parameters") for item in items]
            found = None if any(c is None for c in parsed) else parsed  # type: ignore[assignment]
        if not found:
            return ParsedOutput(_content(text), ())
        calls += [c for c in found if c is not None]
    return ParsedOutput(_content(text[:start]), tuple(calls))


PARSERS = {
    ToolCallFormat.HERMES: parse_hermes,
    ToolCallFormat.LLAMA3_JSON: parse_llama3_json,
    ToolCallFormat.MISTRAL: parse_mistral,
}


def parse_tool_calls(text: str, fmt: ToolCallFormat, names: frozenset[str]) -> ParsedOutput:
    """The calls in ``text`` (decoded with its special tokens) in format ``fmt``."""
    if fmt is ToolCallFormat.AUTO:
        raise ValueError("resolve the format first (detect_format)")
    return PARSERS[fmt](text, names)
