"""The logit processors (grammar mask, logit bias, min_tokens, penalties, min-p): the batched
form is the per-row form row by row, and each rule does what it says on a hand-made row."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.executor.logits_processing import RowContext, process_batch, process_row
from kvgate.executor.sampler import SampleRow, filtered_probs, sample, sample_each
from kvgate.protocol import step as wire

VOCAB = 40


def test_logit_bias_adds_and_can_force_a_token() -> None:
    logits = torch.zeros(VOCAB)
    out = process_row(logits, wire.SamplingParams(logit_bias={3: 2.5, 7: -100.0}), RowContext())
    assert out[3] == 2.5 and out[7] == -100.0 and out[0] == 0.0
    forced = SampleRow("r", 0, wire.SamplingParams(logit_bias={11: 100.0}))
    assert sample(torch.randn(1, VOCAB), [forced]) == [11]


def test_min_tokens_suppresses_the_stopping_tokens_unless_a_grammar_decides() -> None:
    logits = torch.zeros(VOCAB)
    logits[5] = 9.0  # the EOS, most likely
    context = RowContext(outputs=[1], suppressed=[5, 6])
    out = process_row(logits, wire.SamplingParams(min_tokens=3), context)
    assert out[5] == float("-inf") and out[6] == float("-inf") and out[4] == 0.0
    only_eos = torch.zeros(VOCAB, dtype=torch.bool)
    only_eos[5] = True
    constrained = RowContext(outputs=[1], suppressed=[5, 6], constrained=True)
    out = process_row(logits, wire.SamplingParams(min_tokens=3), constrained, only_eos)
    assert out[5] == 9.0 and bool((out[:5] == float("-inf")).all())


def test_penalties_follow_their_rules() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5] + [0.0] * (VOCAB - 4))
    context = RowContext(prompt=[0], outputs=[1, 2, 2])
    rep = process_row(logits, wire.SamplingParams(repetition_penalty=2.0), context)
    # Positive logits divided, negative multiplied; prompt tokens count; others untouched.
    assert rep[:4].tolist() == [1.0, -4.0, 0.5, 0.5]
    freq = process_row(logits, wire.SamplingParams(frequency_penalty=0.5), context)
    assert freq[:4].tolist() == [2.0, -2.5, 0.0, 0.5]  # per occurrence among the outputs only
    pres = process_row(logits, wire.SamplingParams(presence_penalty=0.25), context)
    assert pres[:4].tolist() == [2.0, -2.25, 0.75, 0.5]  # once per token present


def test_min_p_drops_tokens_below_its_share_of_the_top() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filtered_probs(torch.log(probs), wire.SamplingParams(temperature=1.0, min_p=0.2)) > 0
    assert kept.tolist() == [True, True, True, False]  # 0.05 < 0.2 * 0.5


_params = st.builds(
    wire.SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.3]),
    top_k=st.sampled_from([None, 3, 17]),
    top_p=st.sampled_from([1.0, 0.8]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    seed=st.integers(0, 5),
    presence_penalty=st.sampled_from([0.0, 0.4, -1.1]),
    frequency_penalty=st.sampled_from([0.0, 0.3, 1.7]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.7]),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4),
    min_tokens=st.sampled_from([0, 2]),
)
_rows = st.lists(
    st.tuples(
        _params,
        st.lists(st.integers(0, VOCAB - 1), max_size=6),  # prompt
        st.lists(st.integers(0, VOCAB - 1), max_size=8),  # outputs
        st.booleans(),  # constrained
        st.integers(0, 2**32 - 1),  # mask bits
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(_rows, st.integers(0, 1000))
def test_the_batched_processors_and_draws_are_the_per_row_ones(rows: list, seed: int) -> None:  # type: ignore[type-arg]
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), VOCAB, generator=generator) * 3
    allowed = torch.ones(len(rows), VOCAB, dtype=torch.bool)
    samples = []
    for i, (params, prompt, outputs, constrained, bits) in enumerate(rows):
        if constrained:
            pattern = torch.tensor([(bits >> (b % 32)) & 1 for b in range(VOCAB)], dtype=torch.bool)
            pattern[i] = True  # never empty
            allowed[i] = pattern
        suppressed = [1, 2] if len(outputs) < params.min_tokens else []
        context = RowContext(prompt, outputs, suppressed, constrained)
        samples.append(SampleRow(f"r{i}", len(prompt) + len(outputs), params, context))
    constrained = [i for i, s in enumerate(samples) if s.context.constrained]
    masks = allowed[constrained] if constrained else None  # the constrained rows', in order
    params, contexts = [s.params for s in samples], [s.context for s in samples]
    batched = process_batch(logits, params, contexts, masks)
    for i, row in enumerate(samples):
        one = process_row(logits[i], row.params, row.context, allowed[i])
        assert torch.equal(batched[i], one), (i, row)
    tokens = sample(logits, samples, masks)
    assert tokens == sample_each(logits, samples, masks)
    for i, row in enumerate(samples):
        if row.context.constrained:
            assert allowed[i, tokens[i]], "a constrained row drew a token its mask forbids"
