"""What real clients send, on the real-Kafka tier: the official ``openai`` client against
``kvgate gateway``, ``kvgate admission-service`` with transactions (exactly-once on) and a real
``kvgate executor`` serving a tiny random model with a byte tokenizer and a ChatML template — all
real processes on 127.0.0.1, the request and its answer crossing Apache Kafka both ways.

A random model follows no instruction, so every check here is one the grammar mask alone must
make true: a JSON-schema answer parses and conforms, a required tool call names a declared
function with arguments that conform to its schema, ``n`` choices come back as ``n`` answers.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.admission_service.kafka_helpers import Topics, read_results
from tests.harness.kafka import KafkaBroker
from tests.integration.admission_stack import (
    GATEWAY_KEY,
    _env,
    service_settings,
    start_gateway,
    start_service,
)
from tests.reliability.processes import spawn_real_executor, wait_executor_ready

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300, func_only=True)]

MODEL = "tiny"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def _is_person(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 8
        and type(value["age"]) is int
        and 0 <= value["age"] <= 120
    )


async def _structured(api: openai.AsyncOpenAI, temperature: float) -> Any:
    done = await api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        temperature=temperature,
        seed=7,
        max_tokens=160,
    )
    assert done.choices[0].finish_reason == "stop"
    return json.loads(done.choices[0].message.content or "")


async def _tool_call(api: openai.AsyncOpenAI) -> tuple[str, Any, str | None]:
    done = await api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,  # one call: the grammar closes the list after it
        temperature=1.0,
        seed=3,
        max_tokens=160,
    )
    choice = done.choices[0]
    assert choice.message.tool_calls, choice.message
    call = choice.message.tool_calls[0]
    assert call.type == "function"
    return call.function.name, json.loads(call.function.arguments), choice.finish_reason


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A tiny random checkpoint with a byte tokenizer and a ChatML template."""
    model_dir = tmp_path / MODEL
    subprocess.run(
        [sys.executable, "-m", "kvgate", "make-tiny-model", str(model_dir)],
        env=_env(), check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return model_dir


async def test_structured_outputs_tools_and_n_over_real_kafka(
    kafka_broker: KafkaBroker, model_dir: Path, tmp_path: Path
) -> None:
    executor = spawn_real_executor(tmp_path, "exec-a", model_dir, num_blocks=256, block_size=8)
    wait_executor_ready(executor)
    topics = Topics.unique("clients")
    settings = service_settings(kafka_broker.bootstrap, topics, [])
    settings["kafka"]["exactly_once"] = "on"
    settings["executors"]["members"] = [{"name": "exec-a", "endpoint": executor.endpoint}]
    settings["limits"] = {"tokenizer_file": str(model_dir / "tokenizer.json")}
    service = start_service(tmp_path, "service", settings)
    gateway = start_gateway(tmp_path, kafka_broker.bootstrap, topics, "clients-gw", model=MODEL)
    try:
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=GATEWAY_KEY, max_retries=0
        )
        async with api:
            cold, warm, (name, arguments, finish), several = await asyncio.gather(
                _structured(api, 0.0),
                _structured(api, 1.0),
                _tool_call(api),
                api.completions.create(
                    model=MODEL, prompt="Once", n=3, temperature=1.0, seed=11, max_tokens=6,
                    extra_body={"ignore_eos": True},
                ),
            )  # fmt: skip
        assert _is_person(cold), cold
        assert _is_person(warm), warm
        assert name == "get_weather"
        assert finish == "tool_calls"
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str), arguments
        assert sorted(c.index for c in several.choices) == [0, 1, 2]
        assert all(c.finish_reason == "length" for c in several.choices)
        assert several.usage is not None and several.usage.completion_tokens == 18
        # Every request is one result on the results topic, each answered once.
        results = await read_results(kafka_broker.bootstrap, topics.results, 4, settle_s=0.3)
        assert len(results) == len({r.request_id for r in results}) == 4
    finally:
        gateway.process.stop()
        service.process.stop()
        executor.process.stop()
