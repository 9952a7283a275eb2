"""A step result's tokens as objects (protocol 1) or as columns (protocol 2): the same tokens
either way, written for each version as its readers expect, and columns that do not line up
refused."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvgate.protocol import step as wire


def _tokens() -> list[wire.SampledToken]:
    top = [wire.TokenLogprob(token_id=9, logprob=-0.1), wire.TokenLogprob(token_id=3, logprob=-2.0)]
    return [
        wire.SampledToken(request_id="a", position=4, token_id=9, exit_depth=1),
        wire.SampledToken(
            request_id="b", position=7, token_id=9, exit_depth=2, logprob=-0.1, top_logprobs=top
        ),
        wire.SampledToken(request_id="c", position=2, token_id=0, exit_depth=1),
    ]


def test_both_versions_carry_the_same_tokens() -> None:
    result = wire.StepResult(step_id=3, tokens=_tokens())
    v1 = json.loads(result.to_json(1))
    v2 = json.loads(result.to_json(2))
    assert "sampled" not in v1 and len(v1["tokens"]) == 3
    assert v2["tokens"] == [] and v2["sampled"]["request_ids"] == ["a", "b", "c"]
    assert v2["sampled"]["logprobs"] == [None, -0.1, None]
    read = [wire.StepResult.model_validate(raw) for raw in (v1, v2)]
    assert read[0].sampled_tokens() == read[1].sampled_tokens() == _tokens()
    assert list(read[0].token_rows()) == list(read[1].token_rows())
    assert read[0].num_tokens == read[1].num_tokens == 3


def test_columns_leave_logprobs_out_when_no_request_asked() -> None:
    plain = [t for t in _tokens() if t.logprob is None]
    v2 = json.loads(wire.StepResult(step_id=1, tokens=plain).to_json(2))
    assert v2["sampled"]["logprobs"] is None and v2["sampled"]["top_logprobs"] is None
    assert wire.StepResult.model_validate(v2).sampled_tokens() == plain


def test_columns_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValidationError, match="columns of different lengths"):
        wire.SampledTokens(request_ids=["a", "b"], positions=[1], token_ids=[1, 2],
                           exit_depths=[1, 1])  # fmt: skip
    with pytest.raises(ValidationError, match="columns of different lengths"):
        wire.SampledTokens(
            request_ids=["a"], positions=[1], token_ids=[1], exit_depths=[1], logprobs=[]
        )


def test_a_result_carries_one_form() -> None:
    columns = wire.SampledTokens.of(_tokens())
    with pytest.raises(ValidationError, match="not both"):
        wire.StepResult(step_id=1, tokens=_tokens(), sampled=columns)


def test_a_result_made_as_columns_is_written_as_objects_for_version_1() -> None:
    """The simulated executor makes its results as columns; a version-1 peer still gets
    objects (and no ``sampled`` key)."""
    columns = wire.StepResult(step_id=2, sampled=wire.SampledTokens.of(_tokens()))
    v1 = json.loads(columns.to_json(1))
    assert "sampled" not in v1
    assert wire.StepResult.model_validate(v1).tokens == _tokens()
    assert wire.StepResult.model_validate_json(columns.to_json(2)).sampled_tokens() == _tokens()
