"""The growth reserve: admission keeps room for the growth of running work ahead of a candidate."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvgate.scheduler.admission import GrowthReserve, runner_growth_pages
from kvgate.scheduler.config import PreemptionMode, SchedulerConfig
from kvgate.scheduler.events import AdmissionKind
from kvgate.scheduler.state import SchedulerState
from tests.scheduler.harness import Rig


def _tight_rig(growth_reserve_steps: int) -> Rig:
    """7 pages of 2 tokens, recompute only: one request decoding to 12 tokens takes 6 of them."""
    return Rig(
        num_blocks=7,
        block_size=2,
        watermark_ratio=0.0,
        max_num_seqs=4,
        prefill_chunk_size=4,
        max_num_batched_tokens=8,
        preemption="recompute",
        growth_reserve_steps=growth_reserve_steps,
    )


def _preemptions_and_start(growth_reserve_steps: int) -> tuple[list[tuple[str, str]], int]:
    """'high' decodes towards 6 of the 7 pages; 'low' (behind it) arrives while 'high' holds 2.

    Returns the (victim, requester) pairs and the step 'low' first started in."""
    rig = _tight_rig(growth_reserve_steps)
    rig.add("high", prompt_len=4, max_tokens=9, priority=0)  # capacity 12 tokens: 6 pages
    rig.step()
    rig.add("low", prompt_len=4, max_tokens=8, priority=5)  # fill 2 pages, capacity 6
    preempted: list[tuple[str, str]] = []
    while rig.scheduler.has_work:
        rig.step()
        preempted += [(p.victim_id, p.requester_id) for p in rig.scheduler.last_report.preemptions]
    assert set(rig.finished) == {"high", "low"}
    started = rig.finished["low"].stats.first_admitted_step
    assert started is not None
    return preempted, started


def test_a_start_waits_rather_than_being_undone_by_the_growth_of_work_ahead() -> None:
    # Without the reserve 'low' starts at once, into the pages 'high' is about to decode into,
    # and 'high' evicts it a few steps later: its start was wasted.
    wasted, _ = _preemptions_and_start(growth_reserve_steps=0)
    assert wasted == [("low", "high")]
    # With it, 'low' starts only once 'high' has all it will need, and nobody is preempted.
    preempted, started = _preemptions_and_start(growth_reserve_steps=8)
    assert preempted == []
    assert started > 2


def test_work_behind_the_candidate_reserves_nothing() -> None:
    """An important arrival is not held back (nor made to evict) for the growth of less
    important running work: that work is the growth victim, not the arrival."""
    rig = _tight_rig(growth_reserve_steps=8)
    rig.add("low", prompt_len=4, max_tokens=9, priority=5)  # will want 6 of the 7 pages
    rig.step()
    state = rig.scheduler.state
    rig.add("high", prompt_len=4, max_tokens=2, priority=0)
    assert GrowthReserve(state).blocks_for(state.requests["high"]) == 0
    rig.step()
    report = rig.scheduler.last_report
    assert ("high", AdmissionKind.FRESH) in report.admitted
    assert report.preemptions == []
    rig.drain()
    assert set(rig.finished) == {"low", "high"}


@pytest.mark.parametrize(
    ("pricing", "expected_pages"),
    [
        # fill pricing: the runner already holds or is owed its whole fill (5 pages); the reserve
        # adds the 3 decode tokens after it: 13 tokens = 7 pages, 2 more.
        ("fill", 2),
        # first_chunk pricing: nothing else keeps room for the rest of the fill: 7 - 1 held.
        ("first_chunk", 6),
    ],
)
def test_a_filling_runner_reserves_its_fill_and_the_horizon_after_it(
    pricing: str, expected_pages: int
) -> None:
    rig = Rig(
        num_blocks=40,
        block_size=2,
        loops=2,
        watermark_ratio=0.0,
        max_num_seqs=4,
        prefill_chunk_size=2,
        max_num_batched_tokens=8,
        growth_reserve_steps=3,
        admission_pricing=pricing,
    )
    rig.add("filling", prompt_len=10, max_tokens=6)  # capacity 15 tokens
    rig.step()  # one chunk of 2 tokens: one page held
    state = rig.scheduler.state
    runner = state.requests["filling"]
    assert runner.fill is not None and state.pool.num_pages("filling") == 1
    assert runner_growth_pages(state, runner, 3) == expected_pages
    rig.add("later", prompt_len=2, max_tokens=2)
    # Blocks: pages × the model's two planes.
    assert GrowthReserve(state).blocks_for(state.requests["later"]) == 2 * expected_pages


def test_a_decoding_runner_reserves_at_most_its_capacity() -> None:
    rig = Rig(num_blocks=40, block_size=2, watermark_ratio=0.0, growth_reserve_steps=100)
    rig.add("decoding", prompt_len=4, max_tokens=5)  # capacity 8 tokens: 4 pages
    rig.step()
    state = rig.scheduler.state
    runner = state.requests["decoding"]
    assert runner.fill is None
    held = state.pool.num_pages("decoding")
    assert runner_growth_pages(state, runner, 100) == 4 - held
    next_page = state.pool.pages_for(runner.cursor_position + 1)  # horizon 0: the next pass only
    assert runner_growth_pages(state, runner, 0) == max(0, next_page - held)


def _mixed_running_state() -> SchedulerState:
    rig = Rig(
        num_blocks=200,
        block_size=2,
        watermark_ratio=0.0,
        max_num_seqs=16,
        prefill_chunk_size=2,
        max_num_batched_tokens=16,
        growth_reserve_steps=5,
    )
    for index, priority in enumerate((5, 0, 10, 5, 0, 10)):
        rig.add(f"run{index}", prompt_len=3 + 2 * index, max_tokens=4 + index, priority=priority)
    rig.step()
    rig.step()
    for index, priority in enumerate((0, 5, 10, 7)):
        rig.add(f"wait{index}", prompt_len=2, max_tokens=2, priority=priority)
    return rig.scheduler.state


def test_one_walk_per_scan_equals_summing_the_work_ahead_of_each_candidate() -> None:
    state = _mixed_running_state()
    assert len(state.running) == 6

    def summed(request_id: str) -> int:
        key = state.requests[request_id].key
        pages = sum(runner_growth_pages(state, r, 5) for r in state.running if r.key < key)
        return pages * state.num_planes

    ordered = sorted(
        (r for r in state.requests.values() if r.request_id.startswith("wait")), key=lambda r: r.key
    )
    reserve = GrowthReserve(state)
    got = [reserve.blocks_for(r) for r in ordered]
    assert got == [summed(r.request_id) for r in ordered]
    assert got == sorted(got) and got[-1] > got[0]  # more work is ahead of later candidates
    # Asked out of order (the scan never does), it starts over rather than answer wrongly.
    assert reserve.blocks_for(ordered[0]) == summed(ordered[0].request_id)


def test_a_walk_stopped_at_enough_resumes_exactly_for_the_next_candidate() -> None:
    state = _mixed_running_state()
    ordered = sorted(
        (r for r in state.requests.values() if r.request_id.startswith("wait")),
        key=lambda r: r.key,
    )
    exact = [GrowthReserve(state).blocks_for(r) for r in ordered]
    assert exact[-1] > exact[1] > 0
    reserve = GrowthReserve(state)
    # Asked only whether it reaches 1 block: any answer of at least 1 will do.
    assert reserve.blocks_for(ordered[1], enough=1) >= 1
    # A generous ``enough`` is never reached: the answer is exact.
    assert reserve.blocks_for(ordered[2], enough=exact[2] + 1) == exact[2]
    assert reserve.blocks_for(ordered[3]) == exact[3]


def test_no_reserve_when_turned_off_or_when_preemption_is_off() -> None:
    state = _mixed_running_state()
    candidate = state.requests["wait3"]
    assert GrowthReserve(state).blocks_for(candidate) > 0
    state.config = state.config.model_copy(update={"growth_reserve_steps": 0})
    assert GrowthReserve(state).blocks_for(candidate) == 0
    state.config = state.config.model_copy(
        update={"growth_reserve_steps": 5, "preemption": PreemptionMode.OFF}
    )
    assert GrowthReserve(state).blocks_for(candidate) == 0


def test_a_negative_horizon_is_rejected() -> None:
    with pytest.raises(ValidationError, match="growth_reserve_steps"):
        SchedulerConfig(growth_reserve_steps=-1)
