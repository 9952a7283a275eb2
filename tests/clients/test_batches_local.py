"""A batch through ``kvgate run`` (embedded broker, CPU executor, the gateway feeding batches
in its own process) on the local store, with the official ``openai`` client: chat lines
through the chat template, a line the door refuses, the output and error files, listing."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from tests.clients.conftest import Served

pytestmark = pytest.mark.timeout(300)


def _line(i: int, model: str, **body: object) -> dict[str, object]:
    return {
        "custom_id": f"chat-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"question {i}"}],
            "max_completion_tokens": 3,
            **body,
        },
    }


def test_a_chat_batch_through_kvgate_run_on_the_local_store(served: Served) -> None:
    api = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
    lines = [_line(i, served.model) for i in range(12)]
    lines.insert(5, _line(99, served.model, n=0))  # the door refuses n 0
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = api.files.create(file=("chats.jsonl", io.BytesIO(data)), purpose="batch")
    assert uploaded.bytes == len(data)
    assert api.files.content(uploaded.id).content == data  # the stored bytes, as sent
    batch = api.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 240
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = api.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (12, 1)
    assert batch.output_file_id is not None and batch.error_file_id is not None
    output = [json.loads(x) for x in api.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == [f"chat-{i}" for i in range(12)]
    body = output[0]["response"]["body"]
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 3
    [error] = [json.loads(x) for x in api.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "chat-99" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "n"
    assert batch.id in [b.id for b in api.batches.list()]
