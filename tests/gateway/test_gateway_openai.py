"""The gateway through the official ``openai`` client, against real processes on 127.0.0.1:
the embedded broker, the tiny real executor and the admission service (``kvgate run``), and
``kvgate gateway`` replicas. References are independent of the path under test: the
non-streamed answer for the streamed one, the answer without a stop string for the one with,
the results topic for what each replica's reply topic holds."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import aiohttp
import openai
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from kvgate.protocol import topics
from kvgate.protocol.records import REPLY_KIND_HEADER, AbortRequest, InferenceResult

from .conftest import (
    FULL_KEY,
    LIMITED_KEY,
    MODEL,
    SLOW_KEY,
    GatewayProcess,
    Stack,
    record_id,
    start_gateway,
)

pytestmark = pytest.mark.timeout(300)
PROMPT = "Hello, gateway"


def client(gateway: GatewayProcess, key: str = FULL_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)


async def read_topic(
    bootstrap: str, topic: str, *, until: Any, timeout_s: float = 60.0
) -> list[Any]:
    """Records of every partition of ``topic`` from the start, until ``until(records)``."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
        enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    records: list[Any] = []
    try:
        deadline = time.monotonic() + timeout_s
        partitions = None
        while partitions is None:
            await consumer._client.force_metadata_update()
            partitions = consumer.partitions_for_topic(topic)
            assert time.monotonic() < deadline, f"{topic} never appeared"
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while not until(records):
            assert time.monotonic() < deadline, f"{topic}: {len(records)} records, not enough"
            for messages in (await consumer.getmany(timeout_ms=200)).values():
                records.extend(messages)
        return records
    finally:
        await consumer.stop()


# ------------------------------------------------------------------------ the happy paths


async def test_models_completion_and_chat(gateway: GatewayProcess) -> None:
    async with client(gateway) as api:
        models = await api.models.list()
        assert [m.id for m in models.data] == [MODEL]
        done = await api.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
        )
        assert done.object == "text_completion"
        assert done.choices[0].finish_reason == "length"
        assert done.usage is not None and done.usage.completion_tokens == 7
        assert done.usage.prompt_tokens == len(PROMPT.encode())  # the byte tokenizer
        chat = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
            temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert chat.object == "chat.completion"
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage is not None and chat.usage.completion_tokens == 5
        # <|user|>Hi\n<|assistant|> through the template, as bytes
        assert chat.usage.prompt_tokens == len(b"<|user|>Hi\n<|assistant|>")


async def test_stream_assembles_to_the_non_streamed_text(gateway: GatewayProcess) -> None:
    """Greedy decoding: the same tokens under any request id, streamed or not."""
    async with client(gateway) as api:
        plain = await api.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, seed=7,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        stream = await api.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, seed=7, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        parts, finishes, usage = [], [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.text)
                finishes.append(choice.finish_reason)
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    assert usage is not None and usage.completion_tokens == 24
    assert "".join(parts) == plain.choices[0].text


async def test_stream_equals_non_stream_for_one_request_id_and_seed(
    gateway: GatewayProcess, stack: Stack
) -> None:
    """Sampling (temperature 1, seed 11): the streamed chat assembles to the text the service
    wrote to the results topic, and a retry with the same id is answered with that text."""
    rid = f"seeded-{uuid.uuid4().hex}"
    async with client(gateway) as api:
        stream = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "tell me"}], max_tokens=20,
            temperature=1.0, seed=11, stream=True,
            extra_body={"ignore_eos": True, "request_id": rid},
        )  # fmt: skip
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        again = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "tell me"}], max_tokens=20,
            temperature=1.0, seed=11, extra_body={"ignore_eos": True, "request_id": rid},
        )  # fmt: skip
    assert again.choices[0].message.content == streamed
    rid = record_id(rid)
    results = await read_topic(
        stack.bootstrap, topics.RESULTS, until=lambda rs: any(r.key == rid.encode() for r in rs)
    )
    (canonical,) = [
        InferenceResult.model_validate_json(r.value) for r in results if r.key == rid.encode()
    ]
    assert canonical.text == streamed


async def test_stop_string_ends_before_it(gateway: GatewayProcess) -> None:
    async with client(gateway) as api:
        reference = await api.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=64,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        text = reference.choices[0].text
        printable = [i for i, ch in enumerate(text) if ch.isascii() and ch.isprintable()]
        assert printable, f"no printable character to stop on in {text!r}"
        at = printable[0]
        stopped = await api.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0, stop=[text[at]],
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:at]


async def test_logprobs_shapes(gateway: GatewayProcess) -> None:
    async with client(gateway) as api:
        done = await api.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        lp = done.choices[0].logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert len(lp.tokens) == len(lp.token_logprobs) == 5
        assert lp.top_logprobs is not None and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
        assert all(x <= 0.0 for x in lp.token_logprobs)
        chat = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
        )  # fmt: skip
        content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and len(content) == 4
        for entry in content:
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the best


# ------------------------------------------------------------------------ errors and auth


async def _status(call: Any) -> tuple[int, dict[str, Any]]:
    try:
        await call
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        return exc.status_code, body
    raise AssertionError("no error")


async def test_every_error_path(gateway: GatewayProcess) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    async with client(gateway) as api:
        comp = api.completions.create
        chat = api.chat.completions.create
        cases: list[tuple[Any, int, str | None]] = [
            (comp(model=MODEL, prompt="a", extra_body={"bogus": 1}), 400, "bogus"),
            (comp(model=MODEL, prompt="a", n=17), 400, "n"),
            (comp(model=MODEL, prompt="a", temperature=3.5), 400, "temperature"),
            (comp(model=MODEL, prompt="a", suffix="z"), 400, "suffix"),
            (comp(model=MODEL, prompt="a", presence_penalty=3.0), 400, "presence_penalty"),
            (comp(model=MODEL, prompt=["a", "b"]), 400, "prompt"),
            (comp(model=MODEL, prompt="a", seed=-1), 400, "seed"),
            (comp(model=MODEL, prompt="a", logprobs=21, stream=True), 400, "logprobs"),
            (
                chat(
                    model=MODEL,
                    messages=messages,
                    tools=[{"type": "function", "function": {"name": "f"}}],
                    tool_choice={"type": "function", "function": {"name": "g"}},
                ),
                400,
                "tool_choice",
            ),
            (chat(model=MODEL, messages=messages, top_logprobs=2), 400, "top_logprobs"),
            (comp(model=MODEL, prompt="a", max_tokens=100_000), 400, "max_tokens"),
            (comp(model=MODEL, prompt="a", extra_body={"priority": -50}), 400, "priority"),
            (
                comp(model=MODEL, prompt="a", extra_body={"request_id": "bad id!"}),
                400,
                "request_id",
            ),
            (comp(model="nope", prompt="a"), 404, "model"),
            (comp(model=MODEL, prompt="a", extra_body={"deadline_unix_s": 1.0}), 504, None),
        ]
        for call, status, param in cases:
            got, body = await _status(call)
            assert (got, body.get("param")) == (status, param), body
            assert isinstance(body.get("message"), str) and body["message"], body
    async with client(gateway, LIMITED_KEY) as limited:
        got, body = await _status(
            limited.completions.create(model=MODEL, prompt="a", extra_body={"priority": 0})
        )
        assert (got, body.get("param")) == (400, "priority")
        ok = await limited.completions.create(model=MODEL, prompt="a", max_tokens=1)
        assert ok.choices[0].finish_reason in ("length", "stop")
    async with aiohttp.ClientSession() as http:
        url = f"{gateway.base_url}/completions"
        json_type = {"Content-Type": "application/json"}
        async with http.post(
            url, data=b"{not json", headers=_auth(FULL_KEY) | json_type
        ) as response:
            assert response.status == 400
            assert (await response.json())["error"]["code"] == "invalid_json"
        # Bytes sent as bytes (aiohttp says application/octet-stream) are not read as JSON.
        async with http.post(url, data=b"{}", headers=_auth(FULL_KEY)) as response:
            assert response.status == 415
            assert (await response.json())["error"]["code"] == "unsupported_media_type"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_auth_rate_limit_and_health_ports(gateway: GatewayProcess) -> None:
    for key in ("sk-wrong-0123456789abcdef", FULL_KEY[:-1], ""):
        async with client(gateway, key or "x") as api:
            got, body = await _status(api.models.list())
            assert (got, body.get("code")) == (401, "invalid_api_key")
    async with client(gateway, SLOW_KEY) as slow:
        await slow.completions.create(model=MODEL, prompt="a", max_tokens=1)  # the burst of 1
        try:
            await slow.completions.create(model=MODEL, prompt="a", max_tokens=1)
        except openai.RateLimitError as exc:
            assert int(exc.response.headers["Retry-After"]) >= 1
        else:
            raise AssertionError("the second request was not limited")
    # A stream long enough that its tokens are seen before its result (the gateway reads token
    # chunks and results with two readers; a short stream's result may come first, and its text
    # is then sent whole, with no token seen to time).
    async with client(gateway) as api:
        stream = await api.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        assert len([c async for c in stream if c.choices and c.choices[0].text]) > 1
    async with aiohttp.ClientSession() as http:
        api_port = f"http://127.0.0.1:{gateway.port}"
        health = f"http://127.0.0.1:{gateway.health_port}"
        for path in ("/metrics", "/healthz", "/readyz"):
            async with http.get(health + path) as response:
                assert response.status == 200, path
            async with http.get(api_port + path) as response:
                assert response.status == 401, path
            async with http.get(api_port + path, headers=_auth(FULL_KEY)) as response:
                assert response.status == 200, path
        async with http.get(health + "/metrics") as response:
            page = await response.text()
    for name in (
        "kvgate_gateway_time_to_first_token_seconds_bucket",
        "kvgate_gateway_inter_token_latency_seconds_bucket",
        "kvgate_gateway_e2e_request_latency_seconds_bucket",
        "kvgate_gateway_queue_time_seconds_bucket",
        "kvgate_gateway_prompt_tokens_total",
        "kvgate_gateway_generation_tokens_total",
        'kvgate_gateway_rate_limited_total{key="slow"}',
    ):
        assert name in page, name
    assert 'model="tiny",priority="0"' in page


# ------------------------------------------------------------------------ aborts, replicas


async def test_client_disconnect_sends_an_abort(gateway: GatewayProcess, stack: Stack) -> None:
    rid = f"gone-{uuid.uuid4().hex}"
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 1500,
        "stream": True, "ignore_eos": True, "request_id": rid,
    }  # fmt: skip
    async with aiohttp.ClientSession() as http:
        response = await http.post(
            f"{gateway.base_url}/chat/completions", json=body, headers=_auth(FULL_KEY)
        )
        first = await response.content.readline()  # the role chunk: the request runs
        assert first.startswith(b"data: ")
        response.close()  # the client goes away
    rid = record_id(rid)
    aborts = await read_topic(
        stack.bootstrap, topics.ABORTS, until=lambda rs: any(r.key == rid.encode() for r in rs)
    )
    (abort,) = [r for r in aborts if r.key == rid.encode()]
    assert AbortRequest.model_validate_json(abort.value).request_id == rid
    results = await read_topic(
        stack.bootstrap, topics.RESULTS, until=lambda rs: any(r.key == rid.encode() for r in rs)
    )
    (result,) = [
        InferenceResult.model_validate_json(r.value) for r in results if r.key == rid.encode()
    ]
    assert result.finish_reason == "abort"
    assert result.usage.completion_tokens < 1500


async def _one(api: openai.AsyncOpenAI, i: int, *, stream: bool) -> tuple[str, str, int]:
    """(request id, text, completion tokens) of one request through ``api``."""
    key = f"many-{i}-{uuid.uuid4().hex[:8]}"
    rid = record_id(key)
    kwargs: dict[str, Any] = {
        "model": MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": 3 + i % 5, "temperature": 0,
        "extra_body": {"ignore_eos": True, "request_id": key},
    }  # fmt: skip
    if not stream:
        done = await api.completions.create(**kwargs)
        assert done.usage is not None
        return rid, done.choices[0].text, done.usage.completion_tokens
    chunks = await api.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    parts, tokens = [], 0
    async for chunk in chunks:
        assert chunk.id == f"cmpl-{rid}"
        parts.extend(c.text for c in chunk.choices)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return rid, "".join(parts), tokens


async def test_two_replicas_neither_lose_nor_duplicate(
    gateway: GatewayProcess, stack: Stack
) -> None:
    second = start_gateway(stack, "gw-b")
    try:
        async with client(gateway) as a, client(second) as b:
            answers = await asyncio.gather(
                *(_one(a if i % 2 == 0 else b, i, stream=i % 3 == 0) for i in range(30))
            )
        for i, (_, _, tokens) in enumerate(answers):
            assert tokens == 3 + i % 5
        mine = {g.replica_id: {rid for j, (rid, _, _) in enumerate(answers) if j % 2 == k}
                for k, g in enumerate((gateway, second))}  # fmt: skip
        for replica, ids in mine.items():
            topic = f"{topics.REPLIES_PREFIX}{replica}"
            records = await read_topic(
                stack.bootstrap, topic,
                until=lambda rs, ids=ids: ids <= {r.key.decode() for r in rs if _is_result(r)},
            )  # fmt: skip
            results = [r.key.decode() for r in records if _is_result(r)]
            ours = [rid for rid in results if rid.startswith("many-")]
            assert sorted(ours) == sorted(ids)  # each of its answers once, nobody else's
    finally:
        second.stop()


def _is_result(record: Any) -> bool:
    return bool(dict(record.headers).get(REPLY_KIND_HEADER) == b"result")


async def test_retried_id_gets_the_same_answer_after_a_restart_and_elsewhere(
    stack: Stack,
) -> None:
    first = start_gateway(stack, "gw-restart")
    rid = f"retry-{uuid.uuid4().hex}"
    kwargs: dict[str, Any] = {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 3,
        "extra_body": {"ignore_eos": True, "request_id": rid},
    }  # fmt: skip
    try:
        async with client(first) as api:
            original = (await api.completions.create(**kwargs)).choices[0].text
            assert (await api.completions.create(**kwargs)).choices[0].text == original
    finally:
        first.stop()
    restarted = start_gateway(stack, "gw-restart")
    other = start_gateway(stack, "gw-other")
    try:
        async with client(restarted) as api, client(other) as api2:
            again = await api.completions.create(**kwargs)
            elsewhere = await api2.completions.create(**kwargs, stream=True)
            streamed = "".join([c.choices[0].text async for c in elsewhere if c.choices])
        assert again.choices[0].text == original
        assert streamed == original
    finally:
        restarted.stop()
        other.stop()


async def test_a_conversation_is_keyed_to_one_shard_and_a_retry_to_its_id(
    gateway: GatewayProcess, stack: Stack
) -> None:
    """The request records' Kafka keys (which pick the partition, so the admission replica):
    turns under one ``prompt_cache_key`` share it, an idempotent request keeps its id."""
    conversation = f"conv-{uuid.uuid4().hex}"
    rid = f"keyed-{uuid.uuid4().hex}"
    async with client(gateway) as api:
        for turn in ("hello", "and then?"):
            await api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": turn}], max_tokens=2,
                prompt_cache_key=conversation,
            )  # fmt: skip
        await api.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, user=conversation,
            extra_body={"request_id": rid},
        )  # fmt: skip
        answer = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    plain = answer.id.removeprefix("cmpl-")

    def keys(records: list[Any]) -> dict[str, bytes]:
        return {json.loads(r.value)["request_id"]: r.key for r in records}

    def seen(records: list[Any]) -> bool:
        found = keys(records)
        return (
            record_id(rid) in found
            and plain in found
            and (sum(1 for k in found.values() if k == conversation.encode()) >= 2)
        )

    records = await read_topic(stack.bootstrap, topics.REQUESTS, until=seen)
    by_id = keys(records)
    assert by_id[record_id(rid)] == record_id(rid).encode()  # idempotent: keyed by its id
    assert by_id[plain] == plain.encode()
    assert sum(1 for k in by_id.values() if k == conversation.encode()) == 2


@pytest.mark.parametrize("count", [60, 1000])
async def test_many_concurrent_streams(gateway: GatewayProcess, count: int) -> None:
    limits = {"max_connections": count}
    import httpx2  # the transport of the openai client: allow one connection per stream

    api = openai.AsyncOpenAI(
        base_url=gateway.base_url, api_key=FULL_KEY, max_retries=0, timeout=600,
        http_client=openai.DefaultAsyncHttpxClient(limits=httpx2.Limits(**limits)),
    )  # fmt: skip
    async with api:
        answers = await asyncio.gather(*(_one(api, i, stream=True) for i in range(count)))
    ids = [rid for rid, _, _ in answers]
    assert len(set(ids)) == count
    for i, (_, _, tokens) in enumerate(answers):
        assert tokens == 3 + i % 5
    # every one answered exactly once: the json of a sample is well formed
    json.dumps(answers[:3])
