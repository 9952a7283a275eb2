"""The replayed vllm-rlt rules (benchmarks/baselines.py) do what vllm-rlt's code does, point by
point, on small hand-worked scenarios; and they are judged by their own rules."""

from __future__ import annotations

import pytest

from benchmarks.baselines import (
    HostBudgetTooSmall,
    SeedPostFix,
    SeedPreFix,
    SeedPreFixNoAdmissionPreemption,
)
from kvgate.protocol.enums import RestoreMode
from kvgate.protocol.step import StepPlan
from kvgate.scheduler.events import AdmissionKind
from kvgate.scheduler.policy import EvictionReason
from kvgate.scheduler.strategy import Strategy, promises
from tests.scheduler.harness import Rig

HOST = 1000  # vllm-rlt's host memory has no bound


class _RuleRig(Rig):
    """Checks, after every step, the invariants the rule promises (not kvgate's others)."""

    def step(self) -> StepPlan | None:
        self.clock += 1
        plan = self.scheduler.schedule(self.clock)
        self._check()
        if plan is not None:
            self.plans.append(plan)
            self._record(self.scheduler.apply(self.executor.execute(plan)))
            self._check()
        return plan

    def _check(self) -> None:
        promised = promises(self.scheduler.strategy)
        broken = {k: v for k, v in self.scheduler.invariant_violations().items() if k in promised}
        assert not broken, broken


def _rig(strategy: Strategy, num_blocks: int, *, host: int = HOST, **config: object) -> Rig:
    settings: dict[str, object] = {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "prefill_chunk_size": 8,
        "watermark_ratio": 0.0,
        "max_admission_bypasses": 2,
    }
    return _RuleRig(
        num_blocks=num_blocks,
        block_size=2,
        host_snapshot_blocks=host,
        strategy=strategy,
        **(settings | config),
    )


def _preemptions(rig: Rig) -> list[tuple[str, str, EvictionReason, RestoreMode]]:
    return [
        (p.victim_id, p.requester_id, p.reason, p.mode)
        for p in rig.scheduler.last_report.preemptions
    ]


@pytest.mark.parametrize(
    ("strategy", "evicts"),
    [(SeedPreFix(), True), (SeedPostFix(), True), (SeedPreFixNoAdmissionPreemption(), False)],
)
def test_a_fresh_request_evicts_lower_priority_work_before_and_after_the_fix(
    strategy: Strategy, evicts: bool
) -> None:
    """8 blocks; 'low' (priority 10) holds 4 after its first token; 'high' (priority 0, 12
    tokens = 6 blocks) does not fit the 4 free ones. The pre-fix code of the seed's upstream
    already evicted for it (only d40afb7d, older, did not)."""
    rig = _rig(strategy, 8)
    rig.add("low", prompt_len=6, max_tokens=4, priority=10)
    rig.step()
    rig.add("high", prompt_len=12, max_tokens=2, priority=0)
    rig.step()
    admitted = [rid for rid, _ in rig.scheduler.last_report.admitted]
    if evicts:
        assert _preemptions(rig) == [
            ("low", "high", EvictionReason.ADMISSION, RestoreMode.SNAPSHOT)
        ]
        assert admitted == ["high"]
    else:
        assert _preemptions(rig) == [] and admitted == []
    rig.drain()
    assert set(rig.finished) == {"low", "high"}


@pytest.mark.parametrize(("strategy", "bypasses"), [(SeedPreFix(), 0), (SeedPostFix(), 1)])
def test_a_restore_passing_a_blocked_request_counts_only_after_the_fix(
    strategy: Strategy, bypasses: int
) -> None:
    """10 blocks. 'r' (priority 2) holds 2 and is evicted for 'run' (priority 0, 18 tokens =
    9 blocks), which claims its first 4. Next step 'dd' (priority 1, priced at its 4 plus the 5
    'run' has still to claim, 6 free) cannot start and may evict nobody; 'r', behind it,
    restores on a raw fit of its 2 pages. Only the fixed rule counts that as passing 'dd'."""
    rig = _rig(strategy, 10)
    rig.add("r", prompt_len=4, max_tokens=6, priority=2)
    rig.step()
    rig.add("run", prompt_len=18, max_tokens=2, priority=0)
    rig.step()
    assert _preemptions(rig) == [("r", "run", EvictionReason.ADMISSION, RestoreMode.SNAPSHOT)]
    rig.add("dd", prompt_len=8, max_tokens=2, priority=1)
    rig.step()
    assert ("r", AdmissionKind.SNAPSHOT) in rig.scheduler.last_report.admitted
    assert ("dd", AdmissionKind.FRESH) not in rig.scheduler.last_report.admitted
    assert rig.scheduler.state.requests["dd"].bypasses == bypasses
    rig.drain()
    assert set(rig.finished) == {"r", "run", "dd"}


def test_a_preempted_request_queues_behind_waiting_requests_of_its_priority() -> None:
    """Two slots. 'v' (priority 5, larger) and 'xx' run; 'w' (priority 5) waits; 'hhhh'
    (priority 0) evicts 'v' for a slot. 'v' arrived before 'w' but rejoins the queue behind
    it, so 'w' takes the next free slot (kvgate's order by arrival would restore 'v' first)."""
    rig = _rig(SeedPostFix(), 64, max_num_seqs=2)
    rig.add("v", prompt_len=10, max_tokens=8, priority=5)
    rig.add("xx", prompt_len=4, max_tokens=3, priority=5)
    rig.step()
    rig.add("w", prompt_len=4, max_tokens=3, priority=5)
    rig.add("hhhh", prompt_len=4, max_tokens=12, priority=0)
    rig.step()
    assert _preemptions(rig) == [("v", "hhhh", EvictionReason.ADMISSION, RestoreMode.SNAPSHOT)]
    assert [r.request_id for r in rig.scheduler.waiting_order()] == ["v", "w"]  # kvgate's view
    order: list[str] = []
    while rig.scheduler.has_work:
        rig.step()
        order += [rid for rid, _ in rig.scheduler.last_report.admitted if rid in ("v", "w")]
    assert order[:2] == ["w", "v"]


def test_growth_may_evict_a_request_started_in_the_same_step() -> None:
    """6 blocks. 'a' (priority 0) decodes at the end of its second page; 'bb' (priority 10,
    8 tokens) takes the 4 free blocks; then 'a' needs a third page and the only victim is 'bb',
    started in this very step: its start is taken back out of the plan."""
    rig = _rig(SeedPostFix(), 6)
    rig.add("a", prompt_len=3, max_tokens=6, priority=0)
    rig.step()
    rig.step()
    rig.add("bb", prompt_len=8, max_tokens=2, priority=10)
    plan = rig.step()
    assert plan is not None
    assert rig.scheduler.last_report.admitted == [("bb", AdmissionKind.FRESH)]
    assert _preemptions(rig) == [("bb", "a", EvictionReason.GROWTH, RestoreMode.SNAPSHOT)]
    assert not plan.new_requests and not any(a.request_id == "bb" for a in plan.block_appends)
    assert rig.scheduler.state.requests["bb"].restore_mode is None  # nothing was computed
    rig.drain()
    roomy = Rig(num_blocks=64, block_size=2, preemption="off")
    roomy.add("a", prompt_len=3, max_tokens=6, priority=0)
    roomy.add("bb", prompt_len=8, max_tokens=2, priority=10)
    roomy.drain()
    assert {r: (e.output_token_ids, e.exit_depths) for r, e in rig.finished.items()} == {
        r: (e.output_token_ids, e.exit_depths) for r, e in roomy.finished.items()
    }


def test_every_victim_is_snapshotted_and_a_bounded_host_is_refused_clearly() -> None:
    rig = _rig(SeedPreFix(), 8, host=2)
    rig.add("low", prompt_len=6, max_tokens=4, priority=10)
    rig.step()
    rig.add("high", prompt_len=12, max_tokens=2, priority=0)
    with pytest.raises(HostBudgetTooSmall, match="unbounded_host"):
        rig.step()
