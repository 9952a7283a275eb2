"""``n > 1`` through the engine over simulated executors: one answer with every choice, each
choice the tokens of a lone request with its own seed, the prompt prefilled once and shared
through the prefix cache, the choices streamed with their index, and an abort ending them all."""

from __future__ import annotations

import pytest

from kvgate.admission_service.choices import choice_seed
from kvgate.protocol.records import ResultStatus
from kvgate.telemetry import attributes as attr

from .helpers import closing, make_rig, reference_outputs, request_body, settle, until

pytestmark = pytest.mark.timeout(60)

PROMPT_LEN = 40  # ten full pages of four: the pages the choices share
N = 3


def _prefill_tokens(rig: object) -> int:
    spans = rig.spans.get_finished_spans()  # type: ignore[attr-defined]
    return sum(
        int(s.attributes.get(attr.STEP_PREFILL_TOKENS, 0))
        for s in spans
        if s.attributes and attr.STEP_PREFILL_TOKENS in s.attributes
    )


async def test_n_choices_are_one_answer_sharing_one_prefill() -> None:
    body = request_body("multi", prompt_len=PROMPT_LEN, max_tokens=6, n=N)
    alone = [
        request_body(
            f"alone{c}",
            prompt=body["prompt"],
            max_tokens=6,
            sampling={"ignore_eos": True, "seed": choice_seed(1, c)},
        )
        for c in range(N)
    ]
    expected = await reference_outputs(alone, block_size=4)
    rig = make_rig(token_stream=True)
    await rig.add_executors("a", "b", num_blocks=256, block_size=4)

    async def check() -> None:
        rig.submit(body)
        await settle(rig, 1)
        result = rig.sink.answers["multi"]
        assert result.status is ResultStatus.COMPLETED
        assert result.choices is not None and [c.index for c in result.choices] == [0, 1, 2]
        for c, choice in enumerate(result.choices):
            assert (choice.output_token_ids, choice.exit_depths) == expected[f"alone{c}"]
        assert result.output_token_ids == result.choices[0].output_token_ids
        assert result.usage.completion_tokens == 3 * 6
        assert len({tuple(c.output_token_ids) for c in result.choices}) == N, "own seed streams"
        # Every choice ran where choice 0 cached the prompt, which was prefilled once: each
        # other choice computed only the positions after the cached full pages (the last
        # prompt token is never cached).
        assert result.scheduling.executors in (["a"], ["b"])
        cached = (PROMPT_LEN - 1) // 4 * 4
        assert _prefill_tokens(rig) == PROMPT_LEN + (N - 1) * (PROMPT_LEN - cached)
        chunks = rig.sink.streamed
        assert {chunk.request_id for chunk in chunks} == {"multi"}
        for c in range(N):
            streamed = [ch.token_id for ch in chunks if ch.choice == c]
            assert streamed == result.choices[c].output_token_ids
        assert rig.engine.num_tracked == 0

    await closing(rig, check)


async def test_an_abort_ends_every_choice_with_one_answer() -> None:
    rig = make_rig()
    await rig.add_executors("a", num_blocks=256, block_size=4)
    backend = rig.connector.backends["a"]

    async def check() -> None:
        rig.submit(request_body("multi", prompt_len=12, max_tokens=200, n=N))
        await until(
            lambda: sum(1 for rid in rig.engine._requests if rid.startswith("multi")) == N,
            what="every choice placed",
        )
        backend.hold()
        assert rig.engine.abort("multi")
        backend.release()
        await settle(rig, 1)
        assert rig.sink.answers["multi"].status is ResultStatus.ABORTED
        assert len(rig.sink.answer_log) == 1
        await until(lambda: rig.engine.handles["a"].scheduler.num_running == 0, what="freed")
        assert rig.engine.num_tracked == 0

    await closing(rig, check)
