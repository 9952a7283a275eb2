"""The batch package's pure parts: lines from chunks, the journal's fold, ids, segments."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.batch.ids import (
    is_batch_id,
    line_request_id,
    new_batch_id,
    output_file_id,
    parse_line_request_id,
)
from kvgate.batch.journal import (
    Applied,
    BatchTable,
    CancelRecord,
    ClaimRecord,
    parse_journal,
    partition_of,
)
from kvgate.batch.jsonl import LineSplitter
from kvgate.batch.lines import Outcome
from kvgate.batch.objects import BatchStatus
from kvgate.batch.segments import Pending
from tests.batch.fakes import BATCH_ID, record


def _split(data: bytes, cuts: list[int], limit: int, keep: bool = True) -> list[tuple]:
    splitter = LineSplitter(max_line_bytes=limit, keep_data=keep)
    lines = []
    start = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        lines += splitter.feed(data[start:cut])
        start = cut
    last = splitter.finish()
    lines += [] if last is None else [last]
    return [(ln.index, ln.start_byte, ln.end_byte, ln.data, ln.blank) for ln in lines]


def _reference(data: bytes, limit: int) -> list[tuple]:
    """What the lines are, by the rule stated in jsonl.py, computed at once."""
    out, start = [], 0
    pieces = data.split(b"\n")
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        if last and not piece:
            break
        end = start + len(piece) + (0 if last else 1)
        kept = piece.removesuffix(b"\r") if len(piece) <= limit else None
        out.append((index, start, end, kept, not piece.strip()))
        start = end
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from([b"a", b"{}", b" ", b"\r", b"\n", b"xyz" * 5]), max_size=40),
    st.lists(st.integers(0, 200), max_size=8),
    st.integers(1, 20),
)
def test_lines_do_not_depend_on_how_the_stream_is_cut(
    parts: list[bytes], cuts: list[int], limit: int
) -> None:
    data = b"".join(parts)
    cuts = [c for c in cuts if c <= len(data)]
    assert _split(data, cuts, limit) == _reference(data, limit)
    counted = _split(data, cuts, limit, keep=False)
    assert [(i, s, e, b) for i, s, e, _, b in counted] == [
        (i, s, e, b) for i, s, e, _, b in _reference(data, limit)
    ]


def test_a_resumed_split_numbers_lines_and_bytes_from_where_it_starts() -> None:
    splitter = LineSplitter(max_line_bytes=100, first_index=7, first_byte=1000)
    [line] = splitter.feed(b'{"a":1}\n')
    assert (line.index, line.start_byte, line.end_byte) == (7, 1000, 1008)


def test_the_fold_takes_one_creation_and_fences_stale_owners() -> None:
    table = BatchTable()
    created = record()
    assert table.apply(3, created) is Applied.TAKEN
    assert table.apply(3, created.model_copy(update={"priority": 1})) is Applied.KNOWN
    assert table.apply(3, ClaimRecord(partition=3, epoch=1, owner="a")) is Applied.TAKEN
    owned = created.model_copy(update={"status": BatchStatus.IN_PROGRESS, "epoch": 1})
    assert table.apply(3, owned) is Applied.TAKEN
    assert table.apply(3, ClaimRecord(partition=3, epoch=2, owner="b")) is Applied.TAKEN
    assert table.apply(3, ClaimRecord(partition=3, epoch=2, owner="c")) is Applied.STALE
    zombie = owned.model_copy(update={"status": BatchStatus.COMPLETED})  # epoch 1 < 2
    assert table.apply(3, zombie) is Applied.STALE
    assert table.batches[created.id].status is BatchStatus.IN_PROGRESS
    cancel = CancelRecord(batch_id=created.id, requested_at=5)
    assert table.apply(3, cancel) is Applied.TAKEN
    assert table.apply(3, cancel.model_copy(update={"requested_at": 9})) is Applied.KNOWN
    assert table.cancels[created.id].requested_at == 5
    # A cancel not yet acted on shows as cancelling; the record's own status otherwise.
    assert table.batches[created.id].api(cancel)["status"] == "cancelling"
    assert table.batches[created.id].api()["status"] == "in_progress"


def test_records_round_trip_and_partitions_are_stable() -> None:
    rec = record()
    assert parse_journal(rec.model_dump_json().encode()) == rec
    assert partition_of(BATCH_ID, 6) == partition_of(BATCH_ID, 6)
    # Spread over every partition (a stable hash, not Python's salted one).
    assert {partition_of(new_batch_id(), 6) for _ in range(300)} == set(range(6))


def test_line_ids_are_derived_and_parsed_back() -> None:
    batch_id = new_batch_id()
    assert is_batch_id(batch_id)
    assert line_request_id(batch_id, 17) == line_request_id(batch_id, 17)
    assert parse_line_request_id(line_request_id(batch_id, 17)) == (batch_id, 17)
    for other in ("gw-123", f"{batch_id}:x", "batch_zz:1", f"{batch_id}17"):
        assert parse_line_request_id(other) is None
    assert output_file_id(batch_id) == output_file_id(batch_id) != output_file_id(new_batch_id())


def test_pending_hands_out_contiguous_runs_and_ignores_copies() -> None:
    pending = Pending(10, segment_lines=3)
    for index in (11, 10, 13):
        assert pending.add(Outcome(index, index * 10, output=b"x\n", reply_offset=index), 0.0)
    assert not pending.add(Outcome(11, 110), 1.0)  # a copy
    assert pending.run_lines == 2 and pending.oldest_reply_offset() == 10
    assert [o.index for o in pending.take()] == [10, 11]
    assert 10 in pending and 11 in pending and 12 not in pending
    assert not pending.add(Outcome(10, 100), 2.0)  # written already
    for index in (12, 14, 15):
        pending.add(Outcome(index, index * 10), 3.0)
    assert [o.index for o in pending.take()] == [12, 13, 14]  # at most segment_lines
    assert [o.index for o in pending.take()] == [15]
    assert len(pending) == 0


@pytest.mark.parametrize("bad", ["", "batch_123", "file-" + "0" * 24, "batch_" + "g" * 24])
def test_client_ids_are_held_to_the_shape_the_gateway_makes(bad: str) -> None:
    assert not is_batch_id(bad)
