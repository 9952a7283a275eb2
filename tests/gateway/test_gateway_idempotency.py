"""Idempotency only by an explicit key, through the official ``openai`` client against real
processes (``kvgate run`` with the tiny real executor, a ``kvgate gateway``).

``X-Request-Id`` is what proxies and benchmark tools put on every request (often one value for a
whole run): two requests under one X-Request-Id are two requests, each answered for its own
prompt. ``Idempotency-Key`` names one request: a second send under the same key, whatever its
body, gets the first one's answer — when it comes with a key of the same tenant: another tenant's
request under the same key is its own request (a key can never fetch someone else's answer).
"""

from __future__ import annotations

import uuid

import openai
import pytest

from .conftest import FULL_KEY, LIMITED_KEY, MODEL, GatewayProcess

pytestmark = pytest.mark.timeout(300)

FIRST, SECOND = "Hello, gateway", "A different prompt, longer"


def _client(gateway: GatewayProcess, api_key: str = FULL_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.base_url, api_key=api_key, max_retries=0)


async def _ask(
    api: openai.AsyncOpenAI, prompt: str, headers: dict[str, str]
) -> tuple[str, str, int, str]:
    """(response id, text, prompt tokens, echoed X-Request-Id) of one completion."""
    raw = await api.completions.with_raw_response.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )
    done = raw.parse()
    assert done.usage is not None
    return done.id, done.choices[0].text, done.usage.prompt_tokens, raw.headers["x-request-id"]


async def test_requests_sharing_an_x_request_id_both_run(gateway: GatewayProcess) -> None:
    trace = {"X-Request-Id": f"bench-run-{uuid.uuid4().hex[:8]}"}
    async with _client(gateway) as api:
        first = await _ask(api, FIRST, trace)
        second = await _ask(api, SECOND, trace)
    assert first[0] != second[0]  # two requests, two ids
    # Each answered its own prompt (the byte tokenizer: one token per byte).
    assert (first[2], second[2]) == (len(FIRST.encode()), len(SECOND.encode()))
    assert first[3] == second[3] == trace["X-Request-Id"]  # echoed, not used


async def test_requests_sharing_an_idempotency_key_get_one_answer(
    gateway: GatewayProcess,
) -> None:
    key = f"order-{uuid.uuid4().hex}"
    async with _client(gateway) as api:
        first = await _ask(api, FIRST, {"Idempotency-Key": key})
        again = await _ask(api, SECOND, {"Idempotency-Key": f'"{key}"'})  # quoted: the draft's
    assert first[0] == again[0]
    assert first[0].startswith(f"cmpl-{key}@")  # the key, scoped to its tenant
    assert again[1:3] == first[1:3]  # the first request's text and prompt, not a second run
    assert again[3] == first[0].removeprefix("cmpl-")  # the record's id, echoed


async def test_another_tenants_request_under_the_same_key_is_its_own(
    gateway: GatewayProcess,
) -> None:
    """The "full" and "limited" keys are two tenants (each key's name by default)."""
    key = f"order-{uuid.uuid4().hex}"
    async with _client(gateway) as api:
        first = await _ask(api, FIRST, {"Idempotency-Key": key})
    async with _client(gateway, LIMITED_KEY) as other:
        theirs = await _ask(other, SECOND, {"Idempotency-Key": key})
    assert theirs[0] != first[0]
    assert theirs[2] == len(SECOND.encode())  # its own prompt ran (one token per byte)
