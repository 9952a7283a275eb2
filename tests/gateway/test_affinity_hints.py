"""OpenAI's ``prompt_cache_key`` and ``user`` become the record's ``affinity_key`` (the
admission service's placement hint)."""

from __future__ import annotations

import pytest

from kvgate.gateway.openai_api import CompletionBody, parse_body, to_request
from kvgate.protocol.records import ReplyTo

REPLY = ReplyTo(topic="kvgate.replies.gw-0")


def _affinity(**fields: str) -> str | None:
    body = parse_body(CompletionBody, {"model": "m", "prompt": "hi", **fields})
    assert isinstance(body, CompletionBody)
    mapped = to_request(body, request_id="r", priority=0, default_max_tokens=16, reply=REPLY)
    return mapped.request.affinity_key


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"user": "alice"}, "alice"),
        ({"prompt_cache_key": "conversation-7"}, "conversation-7"),
        ({"prompt_cache_key": "conversation-7", "user": "alice"}, "conversation-7"),
        ({"user": ""}, None),
    ],
)
def test_the_placement_hint_is_prompt_cache_key_else_user(
    fields: dict[str, str], expected: str | None
) -> None:
    assert _affinity(**fields) == expected


def test_a_key_longer_than_the_record_takes_is_its_digest() -> None:
    long = "u" * 300
    hint = _affinity(user=long)
    assert hint is not None and hint.startswith("sha256:") and len(hint) == 71
    assert _affinity(user=long) == hint  # the same user, the same executor
