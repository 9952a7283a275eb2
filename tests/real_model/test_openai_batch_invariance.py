"""``kvgate run --batch-invariant`` (SmolLM2 and the OpenAI API, the defaults) through the
official ``openai`` client: a completion's text, token logprobs and alternatives are the same
bits when it is the only request and when it is sent among others at once (sharing steps with
them, its prompt chunked beside theirs). Without ``--batch-invariant`` the logprobs of the two
differ in their last bits."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.real_model.test_openai_gateway import MODEL, running

pytestmark = pytest.mark.timeout(300)
WATCHED = "The lighthouse keeper climbed the stairs every evening, and tonight"
OTHERS = [
    "List three rivers of Europe:",
    "A recipe for bread needs flour, water, salt and yeast. The first step is",
    "Explain in one sentence why the sky looks blue during the day.",
    "Once upon a time, in a small village by the sea,",
    "The committee met on Tuesday to discuss the budget for the new library, which",
]


@pytest.fixture(scope="module")
def invariant_client(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OpenAI]:
    with running(tmp_path_factory.mktemp("run-invariant"), "--batch-invariant") as (_, served):
        yield served


def _ask(client: OpenAI, prompt: str) -> tuple[Any, ...]:
    answer = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=3
    )
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    return choice.text, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs


def test_a_completion_is_the_same_bits_alone_and_in_a_crowd(invariant_client: OpenAI) -> None:
    alone = _ask(invariant_client, WATCHED)
    assert len(alone[1]) >= 4
    with ThreadPoolExecutor(max_workers=len(OTHERS) + 2) as pool:
        crowd = [pool.submit(_ask, invariant_client, p) for p in [*OTHERS, WATCHED, WATCHED]]
        answers = [future.result(timeout=240) for future in crowd]
    assert answers[-2] == alone
    assert answers[-1] == alone
