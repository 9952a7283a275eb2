"""Windowed families through the cache paths the family checks do not cross: a prompt that
starts after a cached prefix longer than the window (prefix caching), and a request moved to
another executor mid-decode (migration), against transformers' greedy ids.

The window is 8 positions (Phi-3's 12), the blocks 4: the shared prefix of 12 tokens spans three
blocks, so the second request's first query sees only the prefix's last block and a half; the
moved request's keys before its window are carried too (a cached key never changes), and the
receiver's window reads only the last 8 of them.
"""

from __future__ import annotations

import pytest

from kvgate.executor.executor import Executor
from kvgate.executor.loader import load_model
from kvgate.protocol import step as wire
from tests.executor.family_cases import WrittenFamilies
from tests.executor.hf_checkpoints import PROMPTS, full_forward_greedy
from tests.executor.test_executor_migration import PROMPT, TICKET, Driver, _move, _tables

# Mistral and Phi-3: every layer slides; Qwen2 and Qwen3: a full layer among sliding ones;
# Gemma 2: sliding and global layers with soft-caps; Gemma 3: each layer type its own RoPE.
GROUP = ["mistral-window", "qwen2-window", "qwen3-window", "phi3", "gemma2", "gemma3_text"]
BLOCK_SIZE = 4
PREFIX = PROMPTS[1][:12]  # three blocks, longer than a window of 8
MAX_TOKENS = 10


def _fill(ex: Executor, step: int, request: wire.NewRequest, tables: list[int], start: int) -> int:
    """Prefill ``request`` from ``start`` on over ``tables``; its first token."""
    result = ex.execute(
        wire.StepPlan(
            step_id=step,
            new_requests=[request],
            block_appends=[wire.BlockAppend(request_id=request.request_id, new_block_ids=[tables])],
            prefill_rows=[
                wire.PrefillRow(
                    request_id=request.request_id,
                    token_start=start,
                    token_end=len(request.prompt_token_ids),
                    depth_first=1,
                    depth_last=1,
                    completes_fill=True,
                )
            ],
        )
    )
    assert result.error is None, result.error
    return result.sampled_tokens()[0].token_id


@pytest.mark.parametrize("name", GROUP)
def test_a_fill_after_a_cached_prefix_longer_than_the_window(
    written: WrittenFamilies, name: str
) -> None:
    checkpoint = written[name]
    greedy = wire.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    first = wire.NewRequest(request_id="first", prompt_token_ids=PROMPTS[1], sampling=greedy)
    second = wire.NewRequest(
        request_id="second", prompt_token_ids=[*PREFIX, 5, 77, 300], sampling=greedy
    )
    ex = Executor(load_model(checkpoint.model_dir), num_blocks=64, block_size=BLOCK_SIZE)
    _fill(ex, 1, first, list(range(5)), 0)
    shared = list(range(len(PREFIX) // BLOCK_SIZE))
    tokens = [_fill(ex, 2, second, [*shared, 40, 41, 42, 43], len(PREFIX))]
    step = 3
    while len(tokens) < MAX_TOKENS:
        decode = wire.DecodeRows(request_ids=["second"], positions=[None], depths=[None])
        result = ex.execute(wire.StepPlan(step_id=step, decode=decode))
        assert result.error is None, result.error
        tokens += [t.token_id for t in result.sampled_tokens()]
        step += 1
    assert tokens == full_forward_greedy(checkpoint.model, second.prompt_token_ids, MAX_TOKENS)


@pytest.mark.parametrize("name", GROUP)
def test_a_request_moved_mid_decode_keeps_transformers_ids(
    written: WrittenFamilies, name: str
) -> None:
    checkpoint = written[name]
    loaded = load_model(checkpoint.model_dir)
    request = wire.NewRequest(
        request_id="a",
        prompt_token_ids=PROMPT,  # 9 tokens, one past the window
        sampling=wire.SamplingParams(max_tokens=14, ignore_eos=True),
    )
    sender = Driver(Executor(loaded, num_blocks=64, block_size=BLOCK_SIZE))
    sender.prefill(request, _tables(sender.ex, 0))
    sender.decode_to_boundary(5)
    sender.run(export=[wire.SnapshotExport(request_id="a", ticket=TICKET)])
    receiver = Driver(
        Executor(loaded, num_blocks=64, block_size=BLOCK_SIZE, host_snapshot_blocks=64)
    )
    _move(sender.ex, receiver.ex)
    receiver.tokens = list(sender.tokens)
    receiver.run(
        adopt=[wire.SnapshotAdopt(request_id="a", ticket=TICKET)],
        swap_in=[wire.SwapIn(request_id="a", block_ids=_tables(receiver.ex, 20))],
    )
    ids = [token for token, _ in receiver.finish(14)]
    assert ids == full_forward_greedy(checkpoint.model, PROMPT, 14)
