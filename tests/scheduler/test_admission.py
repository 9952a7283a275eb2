"""The one admission loop: bounded bypass, deferral order, preflighted preemption, residency."""

from __future__ import annotations

from kvgate.scheduler.events import AdmissionKind
from tests.scheduler.harness import Rig


def _occupied_rig(limit: int) -> Rig:
    """Eight one-token blocks, full reservation; 'run' holds four of them for three steps."""
    rig = Rig(
        num_blocks=8,
        block_size=1,
        max_admission_bypasses=limit,
        watermark_ratio=0.0,
        max_num_seqs=8,
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
        incremental_allocation=False,
    )
    rig.add("run", prompt_len=2, max_tokens=3)  # capacity 4 blocks
    rig.step()
    return rig


def test_bypass_bound_worked_example() -> None:
    """Free 4 blocks; waiting [A needs 6, B 2, C 2], limit 1: A is deferred, B passes it (A's one
    bypass), and the scan stops so C stays behind A."""
    rig = _occupied_rig(limit=1)
    rig.add("A", prompt_len=5, max_tokens=2)
    rig.add("B", prompt_len=1, max_tokens=2)
    rig.add("C", prompt_len=1, max_tokens=2)
    rig.step()
    assert rig.scheduler.last_report.admitted == [("B", AdmissionKind.FRESH)]
    assert rig.scheduler.state.requests["A"].bypasses == 1
    assert [r.request_id for r in rig.scheduler.waiting_order()] == ["A", "C"]
    rig.drain()
    assert set(rig.finished) == {"run", "A", "B", "C"}


def test_a_request_bypassed_to_the_limit_is_never_passed_again() -> None:
    rig = _occupied_rig(limit=2)
    rig.add("A", prompt_len=5, max_tokens=2)
    for i in range(6):
        rig.add(f"s{i}", prompt_len=1, max_tokens=1)
    rig.drain()
    a_start = rig.finished["A"].stats.first_admitted_step
    assert a_start is not None
    assert rig.finished["A"].stats.bypasses == 2
    passed = [
        rid
        for rid, e in rig.finished.items()
        if rid.startswith("s") and (e.stats.first_admitted_step or 0) < a_start
    ]
    assert len(passed) == 2  # exactly the two bypasses the limit allows
    assert all(e.stats.bypasses <= 2 for e in rig.finished.values())


def test_admission_preempts_only_strictly_less_important_work_and_only_when_it_helps() -> None:
    rig = Rig(
        num_blocks=6,
        block_size=2,
        host_snapshot_blocks=6,
        preemption="snapshot",
        max_num_seqs=4,
        watermark_ratio=0.0,
        prefill_chunk_size=4,
        max_num_batched_tokens=8,
    )
    rig.add("low", prompt_len=4, max_tokens=5, priority=9)  # 8 tokens -> 4 pages of 6
    rig.step()
    rig.add("equal", prompt_len=4, max_tokens=3, priority=9)
    rig.step()
    assert not rig.scheduler.last_report.preemptions  # same class never displaces running work
    rig.add("huge", prompt_len=10, max_tokens=3, priority=0)  # 12 tokens: all 6 pages
    rig.step()
    report = rig.scheduler.last_report
    assert {p.victim_id for p in report.preemptions} <= {"low", "equal"}
    assert ("huge", AdmissionKind.FRESH) in report.admitted
    rig.drain()
    assert set(rig.finished) == {"low", "equal", "huge"}
    assert rig.finished["low"].stats.restores == rig.finished["low"].stats.preemptions


def test_no_preemption_when_evicting_everything_eligible_would_not_be_enough() -> None:
    rig = Rig(
        num_blocks=8,
        block_size=1,
        preemption="recompute",
        max_num_seqs=4,
        watermark_ratio=0.0,
        prefill_chunk_size=8,
        max_num_batched_tokens=8,
        incremental_allocation=False,
    )
    rig.add("important", prompt_len=4, max_tokens=3, priority=0)  # 6 blocks
    rig.step()
    rig.add("cheap", prompt_len=1, max_tokens=2, priority=5)  # 2 blocks
    rig.step()
    rig.add("middle", prompt_len=3, max_tokens=2, priority=1)  # 4 blocks: only 'cheap' evictable
    rig.step()
    assert not rig.scheduler.last_report.preemptions
    assert "middle" in {r.request_id for r in rig.scheduler.waiting_order()}
    rig.drain()


def test_slot_limit_preemption_and_restore_round_trip() -> None:
    rig = Rig(
        num_blocks=20,
        block_size=2,
        host_snapshot_blocks=20,
        max_num_seqs=1,
        preemption="snapshot",
        prefill_chunk_size=4,
        max_num_batched_tokens=8,
    )
    rig.add("low", prompt_len=3, max_tokens=8, priority=10)
    for _ in range(4):
        rig.step()
    rig.add("high", prompt_len=3, max_tokens=3, priority=-10)
    rig.drain()
    assert list(rig.finished) == ["high", "low"]
    assert rig.finished["low"].stats.preemptions == 1
    assert rig.finished["low"].stats.restore_modes[0].value == "snapshot"


def test_evicting_the_other_holder_of_a_cached_prefix_is_priced_correctly() -> None:
    """Regression (found by the property tests): evicting a victim that shares the requester's
    cached prefix page makes that page evictable, which raises the requester's claim by as much
    as it frees; counting it as freed made a priced admission fail after the eviction."""
    from kvgate.scheduler.config import Mode, PreemptionMode, SchedulerConfig
    from kvgate.sim.simulate import simulate
    from kvgate.sim.workload import (
        CacheSection,
        ExitMode,
        ModelSection,
        Workload,
        WorkloadRequest,
    )

    workload = Workload(
        model=ModelSection(loops=3, exit=ExitMode.TRACE, vocab_size=8, seed=7),
        cache=CacheSection(num_blocks=24, block_size=4),
        scheduler=SchedulerConfig(
            max_num_seqs=2,
            max_num_batched_tokens=3,
            prefill_chunk_size=1,
            max_admission_bypasses=0,
            admission_scan_limit=1,
            mode=Mode.REFILL,
            incremental_allocation=False,
            preemption=PreemptionMode.SNAPSHOT,
            watermark_ratio=0.0,
            min_residency_steps=0,
        ),
        requests=[
            WorkloadRequest(
                id="r0",
                arrival_step=2,
                prompt=[0] * 9,
                max_tokens=9,
                exit_depths=[3, 1, 1, 1, 1, 1, 1, 1, 1],
                ignore_eos=False,
            ),
            WorkloadRequest(
                id="r1", prompt=[0] * 9, max_tokens=1, priority=1, exit_depths=[3], ignore_eos=False
            ),
            WorkloadRequest(
                id="r2",
                prompt_len=7,
                max_tokens=7,
                exit_depths=[3, 1, 1, 1, 1, 1, 1],
                ignore_eos=False,
            ),
        ],
    )
    report = simulate(workload)
    assert report.passed, report.to_text()
