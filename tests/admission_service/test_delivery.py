"""The partition ledger: the commit point never passes unanswered work, out-of-order answers are
found again through the recorded results position, and answered requests are not run twice."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.admission_service.offsets import (
    CommitPoint,
    PartitionLedger,
    decode_metadata,
    encode_metadata,
)


def test_metadata_round_trip_and_foreign_metadata() -> None:
    assert decode_metadata(encode_metadata(42)) == 42
    assert encode_metadata(None) == ""
    for foreign in (None, "", "something else", "kvgate/1 results_from=x"):
        assert decode_metadata(foreign) is None


def test_nothing_read_nothing_to_commit() -> None:
    assert PartitionLedger().commit_point() is None


def test_commit_point_is_the_lowest_offset_in_flight() -> None:
    ledger = PartitionLedger(committed=10)
    for offset in range(10, 15):
        assert ledger.read(offset) is None
    assert ledger.commit_point() == CommitPoint(10, "")
    # 11 and 13 answered out of order (results at 100 and 101): 10 still blocks the commit.
    point = ledger.commit_point({11: 100, 13: 101})
    assert point == CommitPoint(10, encode_metadata(100))
    ledger.finalize({11: 100, 13: 101})
    ledger.committed_at(point)
    assert ledger.commit_point() is None  # nothing new
    ledger.finalize({10: 102})
    point = ledger.commit_point()
    # 12 is the lowest in flight; the answer to 13 (at results offset 101) lies above it.
    assert point == CommitPoint(12, encode_metadata(101))
    ledger.committed_at(point)
    ledger.finalize({12: 103, 14: None})  # 14 was dead-lettered without a result
    point = ledger.commit_point()
    assert point == CommitPoint(15, encode_metadata(104))  # past everything written so far


def test_answered_offsets_found_by_the_scan_are_skipped_and_count_as_final() -> None:
    ledger = PartitionLedger(committed=5, answered={7: 40, 9: 41}, results_end=50)
    assert ledger.read(5) is None
    assert ledger.read(6) is None
    assert ledger.read(7) == 40  # answered by the previous owner: do not run again
    # Until 9 is read again, its answer must stay findable: metadata points at or below 41.
    point = ledger.commit_point({5: 50})
    assert point is not None and point.offset == 6
    assert decode_metadata(point.metadata) == 40
    assert ledger.read(8) is None
    assert ledger.read(9) == 41
    ledger.finalize({5: 50, 6: 51, 8: 52})
    point = ledger.commit_point()
    assert point == CommitPoint(10, encode_metadata(53))


def test_scan_end_is_the_metadata_when_nothing_was_written() -> None:
    ledger = PartitionLedger(committed=0, results_end=77)
    ledger.read(0)
    ledger.finalize({0: None})
    assert ledger.commit_point() == CommitPoint(1, encode_metadata(77))


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**31), st.integers(min_value=1, max_value=60))
def test_random_completion_orders_never_commit_past_unanswered_work(seed: int, count: int) -> None:
    """A next owner starting at the commit point and skipping what the results scan finds runs
    every unanswered request exactly once and no answered one again."""
    rng = random.Random(seed)
    ledger = PartitionLedger(committed=0, results_end=0)
    results: list[int] = []  # results partition: request offset per results offset
    for offset in range(count):
        ledger.read(offset)
    pending = list(range(count))
    rng.shuffle(pending)
    answered_now = rng.randint(0, count)
    committed: CommitPoint | None = None
    for offset in pending[:answered_now]:
        finals: dict[int, int | None] = {}
        if rng.random() < 0.8:
            finals[offset] = len(results)
            results.append(offset)
        else:
            finals[offset] = None  # dead-lettered without a result
        point = ledger.commit_point(finals)
        ledger.finalize(finals)
        if point is not None and rng.random() < 0.7:
            ledger.committed_at(point)
            committed = point
    done = set(pending[:answered_now])
    start = committed.offset if committed is not None else 0
    assert all(o in done for o in range(start)), "committed past unanswered work"
    from_results = decode_metadata(committed.metadata) if committed is not None else None
    scan_from = from_results if from_results is not None else 0
    found = {results[r] for r in range(scan_from, len(results)) if results[r] >= start}
    with_result = {o for o in done if o in results}
    # Every answered request at or above the commit point that wrote a result is found.
    assert {o for o in with_result if o >= start} <= found
