"""The background class (``background_priority``): beside more important work it holds at most
``background_step_tokens`` running requests and that many token passes of a step, and it still
progresses every step; alone it has the whole step."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvgate.protocol.step import StepPlan
from kvgate.scheduler.config import SchedulerConfig
from tests.scheduler.harness import Rig

BACKGROUND = 100
CAP = 3


def _rig(**config: object) -> Rig:
    settings: dict[str, object] = {
        "num_blocks": 4096,
        "max_num_seqs": 16,
        "prefill_chunk_size": 32,
        "max_num_batched_tokens": 64,
        "background_priority": BACKGROUND,
        "background_step_tokens": CAP,
    }
    return Rig(**(settings | config))


def _passes(plan: StepPlan, ids: set[str]) -> int:
    """Token passes of ``plan``'s rows that belong to ``ids``."""
    prefill = sum(
        (row.token_end - row.token_start) * (row.depth_last - row.depth_first + 1)
        for row in plan.prefill_rows
        if row.request_id in ids
    )
    decode = sum(1 for rid in (plan.decode.request_ids if plan.decode else []) if rid in ids)
    return prefill + decode


def _run(rig: Rig, foreground: set[str], background: set[str]) -> list[tuple[bool, int, int]]:
    """Per step: whether foreground work was outstanding, the background's passes, and how many
    background requests held a slot after admission."""
    steps = []
    for _ in range(2000):
        if not rig.scheduler.has_work:
            return steps
        present = not foreground <= rig.finished.keys()
        plan = rig.step()
        running = {r.request_id for r in rig.scheduler.state.running}
        if plan is not None:
            steps.append((present, _passes(plan, background), len(running & background)))
    raise AssertionError("did not drain")


def _mixed(rig: Rig) -> tuple[set[str], set[str]]:
    foreground = {f"i{i}" for i in range(3)}
    background = {f"b{i}" for i in range(8)}
    for n, rid in enumerate(sorted(background)):
        prompt = tuple((7 * i + 13 * n) % 97 for i in range(40))  # no prefix shared
        rig.add(rid, prompt_len=40, max_tokens=6, priority=BACKGROUND, prompt=prompt)
    for rid in sorted(foreground):
        rig.add(rid, prompt_len=8, max_tokens=60, priority=0)
    return foreground, background


def test_beside_other_work_the_background_gets_its_cap_and_alone_the_step() -> None:
    rig = _rig()
    foreground, background = _mixed(rig)
    steps = _run(rig, foreground, background)
    beside = [(passes, held) for present, passes, held in steps if present]
    alone = [passes for present, passes, _ in steps if not present]
    assert beside and alone
    assert max(passes for passes, _ in beside) == CAP
    assert max(held for _, held in beside) <= CAP
    # Every step beside the other work advanced a held background request.
    assert all(passes >= 1 for passes, held in beside if held)
    assert max(alone) > CAP  # alone: the whole budget
    assert background <= rig.finished.keys()


def test_without_a_background_class_batch_rows_take_the_budget() -> None:
    """The same requests with the class off: the low priority's rows fill what the budget
    leaves beside the other work (what the cap prevents)."""
    rig = _rig(background_priority=None)
    foreground, background = _mixed(rig)
    steps = _run(rig, foreground, background)
    assert max(passes for present, passes, _ in steps if present) > CAP


def test_a_background_request_finishes_while_interactive_work_fills_every_step() -> None:
    """Two new interactive requests a step ask for more than the step's budget, for good; the
    background request still advances every step by the passes kept for it, and finishes
    within its prompt and outputs at one pass a step."""
    rig = _rig(max_num_seqs=256, max_num_batched_tokens=32, prefill_chunk_size=16)
    rig.add("b", prompt_len=30, max_tokens=10, priority=BACKGROUND)
    for step in range(30 + 10 + 2):
        for n, half in enumerate("ab"):
            prompt = tuple((5 * i + 11 * step + 3 * n) % 97 for i in range(16))
            rig.add(f"i{step}{half}", prompt_len=16, max_tokens=12, priority=0, prompt=prompt)
        rig.step()
        if "b" in rig.finished:
            break
    assert "b" in rig.finished
    added = {f"i{n}{half}" for n in range(step + 1) for half in "ab"} | {"b"}
    # The interactive work wanted more than each step held from the start to the end.
    assert all(_passes(plan, added) == 32 for plan in rig.plans[2:])


def test_wavefront_chunks_begun_alone_fit_beside_other_work() -> None:
    """A looped model with wavefront prefill: background fills begin alone (chunks of up to
    the whole budget), then long interactive requests arrive. A background fill's chunks are
    cut to the cap, so their deeper loops fit beside the interactive work: the background
    finishes first instead of waiting for the interactive requests to end."""
    rig = Rig(
        num_blocks=4096,
        loops=3,
        max_num_seqs=16,
        prefill_chunk_size=24,
        max_num_batched_tokens=48,
        wavefront_prefill=True,
        background_priority=BACKGROUND,
        background_step_tokens=CAP,
    )
    for n in range(2):
        prompt = tuple((7 * i + 13 * n) % 97 for i in range(30))
        rig.add(f"b{n}", prompt_len=30, max_tokens=5, priority=BACKGROUND, prompt=prompt)
    rig.step()
    for n in range(2):
        rig.add(f"i{n}", prompt_len=12, max_tokens=150, priority=0)
    order: list[str] = []
    for _ in range(2000):
        if not rig.scheduler.has_work:
            break
        rig.step()
        order += [rid for rid in rig.finished if rid not in order]
    assert set(order) == {"b0", "b1", "i0", "i1"}
    assert set(order[:2]) == {"b0", "b1"}


def test_the_class_needs_priority_order_and_a_share_of_a_pass_at_every_loop() -> None:
    """Without wavefront prefill a prefill token costs a pass at every loop: the share is raised
    to the loop count (the admission service's default of 2 on a model of 3 loops)."""
    with pytest.raises(ValidationError, match="background_priority needs policy: priority"):
        SchedulerConfig(policy="fcfs", background_priority=BACKGROUND)
    rig = Rig(num_blocks=64, loops=3, background_priority=BACKGROUND, background_step_tokens=2)
    assert rig.scheduler.config.background_step_tokens == 3
    wavefront = Rig(
        num_blocks=64,
        loops=3,
        wavefront_prefill=True,
        background_priority=BACKGROUND,
        background_step_tokens=2,
    )
    assert wavefront.scheduler.config.background_step_tokens == 2
