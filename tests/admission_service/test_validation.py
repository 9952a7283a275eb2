"""Validation at the boundary: every kind of bad input gets its code, a clear reason and — when
one can be read — the request id; good input becomes the scheduler's RequestSpec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kvgate.admission_service.settings import LimitsSettings
from kvgate.admission_service.tokenizer import TokenizerError, load_tokenizer
from kvgate.admission_service.validation import (
    Accepted,
    Rejection,
    build_spec,
    validate_abort,
    validate_request,
)
from kvgate.protocol.records import RejectCode

from .helpers import record, request_body

LIMITS = LimitsSettings(
    max_message_bytes=4096, max_prompt_tokens=64, max_output_tokens=100, priority_min=-5,
    priority_max=5,
)  # fmt: skip


def rejected(value: bytes | dict[str, object] | None, key: bytes | None = None) -> Rejection:
    verdict = validate_request(record(value, 0, key=key), LIMITS, None)
    assert isinstance(verdict, Rejection), verdict
    return verdict


def test_valid_request_becomes_a_spec() -> None:
    body = request_body("ok-1", prompt=[5, 6, 7], max_tokens=9, priority=-2)
    body["sampling"] = {"temperature": 0.5, "top_k": 4, "seed": 3}
    body["loops"] = {"min_loops": 2, "max_loops": 3}
    body["deadline_unix_s"] = 2e9
    verdict = validate_request(record(body, 0), LIMITS, None)
    assert isinstance(verdict, Accepted)
    spec = build_spec(verdict, "00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    assert spec.request_id == "ok-1"
    assert spec.prompt_token_ids == (5, 6, 7)
    assert spec.sampling.max_tokens == 9 and spec.sampling.top_k == 4
    assert spec.loops.min_loops == 2 and spec.loops.max_loops == 3
    assert spec.priority == -2 and spec.deadline_s == 2e9
    assert spec.traceparent is not None


@pytest.mark.parametrize(
    ("value", "code", "reason", "request_id"),
    [
        (b"{not json", RejectCode.MALFORMED_JSON, "not JSON", "from-key"),
        (b"\xff\xfe", RejectCode.MALFORMED_JSON, "UTF-16", "from-key"),
        (None, RejectCode.MALFORMED_JSON, "no value", "from-key"),
        (b"[1, 2]", RejectCode.SCHEMA, "must be a JSON object", "from-key"),
        (
            b"x" * 5000,
            RejectCode.TOO_LARGE,
            "5000 bytes; limits.max_message_bytes is 4096",
            "from-key",
        ),
        (
            {"request_id": "v2", "schema_version": 2, "prompt": [1]},
            RejectCode.UNSUPPORTED_VERSION,
            "schema_version 2 is not supported",
            "v2",
        ),
        (
            {"request_id": "extra", "prompt": [1], "temperature": 1.0},
            RejectCode.SCHEMA,
            "temperature: Extra inputs are not permitted",
            "extra",
        ),
        (
            {"request_id": "noprompt"},
            RejectCode.SCHEMA,
            "give exactly one of prompt and messages",
            "noprompt",
        ),
        ({"request_id": "empty", "prompt": []}, RejectCode.SCHEMA, "prompt", "empty"),
        ({"request_id": "neg", "prompt": [1, -3]}, RejectCode.SCHEMA, "prompt", "neg"),
        (
            {"request_id": "zero", "prompt": [1], "max_tokens": 0},
            RejectCode.SCHEMA,
            "max_tokens 0 only scores the prompt",
            "zero",
        ),
        (
            {"request_id": "loops", "prompt": [1], "loops": {"min_loops": 3, "max_loops": 2}},
            RejectCode.SCHEMA,
            "max_loops (2) < min_loops (3)",
            "loops",
        ),
        (
            {"request_id": "bad id!", "prompt": [1]},
            RejectCode.SCHEMA,
            "request_id",
            "from-key",
        ),
        (
            {"request_id": "text", "prompt": "hello"},
            RejectCode.TEXT_WITHOUT_TOKENIZER,
            "no tokenizer",
            "text",
        ),
        (
            {"request_id": "long", "prompt": list(range(65))},
            RejectCode.PROMPT_TOO_LONG,
            "65 tokens; limits.max_prompt_tokens is 64",
            "long",
        ),
        (
            {"request_id": "many", "prompt": [1], "max_tokens": 101},
            RejectCode.MAX_TOKENS_TOO_LARGE,
            "max_tokens 101 exceeds limits.max_output_tokens 100",
            "many",
        ),
        (
            {"request_id": "prio", "prompt": [1], "priority": 6},
            RejectCode.PRIORITY_OUT_OF_RANGE,
            "priority 6 is outside [-5, 5]",
            "prio",
        ),
    ],
)
def test_bad_input_is_rejected_with_code_reason_and_id(
    value: bytes | dict[str, object] | None, code: RejectCode, reason: str, request_id: str
) -> None:
    verdict = rejected(value, key=b"from-key")
    assert verdict.code is code
    assert reason in verdict.reason
    assert verdict.request_id == request_id


def test_no_readable_id_means_none() -> None:
    assert rejected(b"{broken", key=None).request_id is None
    assert rejected(b"{broken", key=b"\xff").request_id is None
    assert rejected(b"{broken", key=b"has space").request_id is None


def test_schema_errors_list_at_most_three_problems() -> None:
    body = {"request_id": "many-errors", "prompt": "", "max_tokens": -1, "priority": "x", "a": 1}
    reason = rejected(body).reason
    assert reason.count(";") == 2 and "more)" in reason


def _word_tokenizer(tmp_path: Path) -> Path:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_text_prompts_with_a_tokenizer(tmp_path: Path) -> None:
    codec = load_tokenizer(_word_tokenizer(tmp_path))
    verdict = validate_request(
        record(request_body("t", prompt="hello world hello"), 0), LIMITS, codec
    )
    assert isinstance(verdict, Accepted)
    assert verdict.prompt_token_ids == (1, 2, 1)
    assert codec.decode([2, 1]) == "world hello"


def test_bad_tokenizer_files_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="is not a file"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TokenizerError, match="cannot be loaded"):
        load_tokenizer(tmp_path / "bad.json")


def test_aborts_are_validated_too() -> None:
    good = validate_abort(record({"request_id": "r1"}, 0), 4096)
    assert not isinstance(good, Rejection) and good.request_id == "r1"
    bad = validate_abort(record(json.dumps({"id": "r1"}).encode(), 0), 4096)
    assert isinstance(bad, Rejection) and bad.code is RejectCode.SCHEMA


def test_spec_parameters_equal_validated_protocol_models() -> None:
    """build_spec skips re-validation; what it builds must equal what validation would."""
    from kvgate.protocol.step import LoopParams, SamplingParams

    body = request_body("eq", prompt=[1, 2], max_tokens=7)
    body["sampling"] = {
        "temperature": 0.25, "top_p": 0.5, "top_k": 3, "seed": 11, "min_p": 0.1,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
        "logit_bias": {"5": -100, "9": 2.5}, "min_tokens": 2, "stop_token_ids": [4],
    }  # fmt: skip
    body["loops"] = {"min_loops": 1, "max_loops": 2, "exit_threshold": 0.5}
    body["structured_output"] = {"regex": "[ab]+"}
    body["prompt_logprobs"] = 1
    verdict = validate_request(record(body, 0), LIMITS, None)
    assert isinstance(verdict, Accepted)
    spec = build_spec(verdict, None)
    assert spec.sampling == SamplingParams.model_validate(spec.sampling.model_dump())
    assert spec.loops == LoopParams.model_validate(spec.loops.model_dump())
    assert spec.sampling.model_dump() == {
        "temperature": 0.25, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 11,
        "max_tokens": 7, "ignore_eos": False, "min_tokens": 2, "stop_token_ids": [4],
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
        "logit_bias": {5: -100.0, 9: 2.5}, "grammar": {"kind": "regex", "source": "[ab]+"},
        "logprobs": None, "prompt_logprobs": 1,
    }  # fmt: skip


PRODUCTION = LimitsSettings()  # the defaults a deployment runs with


def _strictly(value: bytes) -> Rejection:
    verdict = validate_request(record(value, 0, key=b"from-key"), PRODUCTION, None)
    assert isinstance(verdict, Rejection), f"{value[:60]!r} was accepted"
    return verdict


@pytest.mark.parametrize(
    ("value", "code", "reason"),
    [
        # Wire types are exact: no strings or booleans for numbers, no non-finite numbers.
        (b'{"request_id": "w-1", "prompt": [1], "max_tokens": "4"}', RejectCode.SCHEMA,
         "max_tokens: Input should be a valid integer"),
        (b'{"request_id": "w-1", "prompt": [1], "max_tokens": true}', RejectCode.SCHEMA,
         "max_tokens: Input should be a valid integer"),
        (b'{"request_id": "w-1", "prompt": [1], "max_tokens": 4.0}', RejectCode.SCHEMA,
         "max_tokens: Input should be a valid integer"),
        (b'{"request_id": "w-1", "prompt": [1], "priority": false}', RejectCode.SCHEMA,
         "priority: Input should be a valid integer"),
        (b'{"request_id": "w-1", "prompt": ["1"]}', RejectCode.SCHEMA, "prompt"),
        (b'{"request_id": "w-1", "prompt": [1], "deadline_unix_s": Infinity}',
         RejectCode.MALFORMED_JSON, "Infinity is not a JSON number"),
        (b'{"request_id": "w-1", "prompt": [1], "sampling": {"temperature": NaN}}',
         RejectCode.MALFORMED_JSON, "NaN is not a JSON number"),
        (b'{"request_id": "w-1", "prompt": [1], "deadline_unix_s": 1e999}', RejectCode.SCHEMA,
         "deadline_unix_s: Input should be a finite number"),
        # Encodings: UTF-8 only, said so plainly.
        (b'\xef\xbb\xbf{"request_id": "w-1", "prompt": [1]}', RejectCode.MALFORMED_JSON,
         "byte-order mark"),
        ('{"request_id": "w-1", "prompt": [1]}'.encode("utf-16"), RejectCode.MALFORMED_JSON,
         "UTF-16"),
        ('{"request_id": "w-1", "prompt": [1]}'.encode("utf-16-le"), RejectCode.MALFORMED_JSON,
         "UTF-16"),
        ('{"request_id": "w-1", "prompt": [1]}'.encode("utf-32"), RejectCode.MALFORMED_JSON,
         "UTF-32"),
        (b'{"request_id": "w-1", "prompt": "caf\xe9"}', RejectCode.MALFORMED_JSON,
         "not UTF-8"),
        # The version must be the integer this service reads; a string is a type error.
        (b'{"schema_version": "1", "request_id": "w-1", "prompt": [1]}', RejectCode.SCHEMA,
         "schema_version must be the integer 1, not the string '1'"),
        (b'{"schema_version": true, "request_id": "w-1", "prompt": [1]}', RejectCode.SCHEMA,
         "schema_version must be the integer 1, not true"),
        (b'{"schema_version": 2, "request_id": "w-1", "prompt": [1]}',
         RejectCode.UNSUPPORTED_VERSION, "schema_version 2 is not supported"),
    ],
)  # fmt: skip
def test_wire_types_are_strict_and_reasons_precise(
    value: bytes, code: RejectCode, reason: str
) -> None:
    verdict = _strictly(value)
    readable = code is not RejectCode.MALFORMED_JSON  # else only the key names it
    assert (verdict.code, verdict.request_id) == (code, "w-1" if readable else "from-key")
    assert reason in verdict.reason, verdict.reason


def test_strict_aborts() -> None:
    verdict = validate_abort(record(b'{"request_id": 5}', 0), 1 << 20)
    assert isinstance(verdict, Rejection) and verdict.code is RejectCode.SCHEMA


def _with_chat_template(tmp_path: Path, template: str) -> Path:
    path = _word_tokenizer(tmp_path)
    config = {"chat_template": template, "eos_token": "world"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _chat(rid: str, messages: list[dict[str, str]]) -> dict[str, object]:
    body = request_body(rid)
    del body["prompt"]
    return body | {"messages": messages}


def test_messages_go_through_the_chat_template(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }} {{ eos_token }} {% endfor %}"
    template += "{% if add_generation_prompt %}hello{% endif %}"
    codec = load_tokenizer(_with_chat_template(tmp_path, template))
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "x"}]
    verdict = validate_request(record(_chat("c", messages), 0), LIMITS, codec)
    assert isinstance(verdict, Accepted)
    assert verdict.prompt_token_ids == (1, 2, 0, 2, 1)  # hello world [UNK] world hello


def test_messages_without_a_template_or_refused_by_it_are_rejected(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hello"}]
    without = validate_request(
        record(_chat("c", messages), 0), LIMITS, load_tokenizer(_word_tokenizer(tmp_path))
    )
    assert isinstance(without, Rejection) and without.code is RejectCode.CHAT_TEMPLATE
    assert "no chat template" in without.reason
    refusing = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}"
    refusing += "{% endif %}"
    codec = load_tokenizer(_with_chat_template(tmp_path, refusing))
    verdict = validate_request(record(_chat("c", messages), 0), LIMITS, codec)
    assert isinstance(verdict, Rejection) and verdict.code is RejectCode.CHAT_TEMPLATE
    assert "system first" in verdict.reason
    no_tokenizer = validate_request(record(_chat("c", messages), 0), LIMITS, None)
    assert isinstance(no_tokenizer, Rejection)
    assert no_tokenizer.code is RejectCode.TEXT_WITHOUT_TOKENIZER
    assert "messages" in no_tokenizer.reason


def test_prompt_and_messages_together_or_neither_are_schema_errors() -> None:
    both = request_body("b") | {"messages": [{"role": "user", "content": "hi"}]}
    assert "exactly one of prompt and messages" in rejected(both).reason
    neither = request_body("n")
    del neither["prompt"]
    assert rejected(neither).code is RejectCode.SCHEMA
