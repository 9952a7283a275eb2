"""The real executor's side of migration: export → frames → import → adopt → swap-in → decode.

A request decoded part-way on one executor and moved with its KV to another (different block
ids, the same tiny checkpoint) finishes with exactly the tokens and exit depths of a run that
never moved — greedy and seeded sampling, plain and looped models. A receiver whose layout
differs (another block size, another checkpoint) refuses the snapshot, naming the field.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel, load_model
from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
from kvgate.protocol import migration
from kvgate.protocol import step as wire
from kvgate.protocol.enums import ModelFamily
from kvgate.step_server.snapshots import decode_frames, stage

TICKET = "k" * 24
PROMPT = [9, 8, 7, 6, 5, 4, 3, 2, 1]


def _request(temperature: float) -> wire.NewRequest:
    return wire.NewRequest(
        request_id="a",
        prompt_token_ids=PROMPT,
        sampling=wire.SamplingParams(
            temperature=temperature, seed=4, max_tokens=14, ignore_eos=True
        ),
        loops=wire.LoopParams(exit_threshold=0.6),
    )


class Driver:
    """Steps one request through an executor by hand (block ids chosen by the test)."""

    def __init__(self, ex: Executor) -> None:
        self.ex = ex
        self.step = 0
        self.tokens: list[tuple[int, int]] = []  # (token id, exit depth)

    def run(self, **fields: object) -> wire.StepResult:
        self.step += 1
        result = self.ex.execute(wire.StepPlan(step_id=self.step, **fields))  # type: ignore[arg-type]
        assert result.error is None, result.error
        self.tokens += [(t.token_id, t.exit_depth) for t in result.tokens]
        return result

    def prefill(self, request: wire.NewRequest, tables: list[list[int]]) -> None:
        loops = self.ex.info.num_loops
        self.run(
            new_requests=[request],
            block_appends=[wire.BlockAppend(request_id="a", new_block_ids=tables)],
            prefill_rows=[wire.PrefillRow(request_id="a", token_start=0, token_end=len(PROMPT),
                                          depth_first=1, depth_last=loops, completes_fill=True)],
        )  # fmt: skip

    def decode(self) -> wire.StepResult:
        return self.run(decode=wire.DecodeRows(request_ids=["a"], positions=[None], depths=[None]))

    def decode_to_boundary(self, tokens: int) -> None:
        """Decode until ``tokens`` tokens are out and no pass of the next one has begun."""
        while len(self.tokens) < tokens or self.ex._requests["a"].cursor.passes_done:  # type: ignore[union-attr]
            self.decode()

    def finish(self, max_tokens: int) -> list[tuple[int, int]]:
        while len(self.tokens) < max_tokens:
            self.decode()
        return self.tokens


def _tables(ex: Executor, first: int) -> list[list[int]]:
    """Enough pages per plane for the prompt and every output, from block ``first`` on."""
    pages = -(-(len(PROMPT) + 14) // ex.info.block_size)
    planes = ex.info.num_loops
    return [[first + plane * pages + page for page in range(pages)] for plane in range(planes)]


def _move(sender: Executor, receiver: Executor) -> migration.SnapshotHeader:
    """Export ``a`` on the sender, carry it as frames, stage it on the receiver."""
    taken = sender.take_export(TICKET)
    assert taken is not None
    frames = migration.encode(*taken, chunk_bytes=4096)
    header, payload = decode_frames(frames, max_bytes=1 << 30, layout=receiver.snapshot_layout)
    stage(receiver, TICKET, "a", header, payload)
    return header


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_moved_request_decodes_as_if_it_never_moved(
    family_model: LoadedModel, temperature: float
) -> None:
    request = _request(temperature)
    reference = Driver(Executor(family_model, num_blocks=64, block_size=4))
    reference.prefill(request, _tables(reference.ex, 0))
    expected = reference.finish(request.sampling.max_tokens)

    sender = Driver(Executor(family_model, num_blocks=64, block_size=4))
    sender.prefill(request, _tables(sender.ex, 0))
    sender.decode_to_boundary(5)
    moved_at = len(sender.tokens)
    sender.run(export=[wire.SnapshotExport(request_id="a", ticket=TICKET)])
    assert sender.ex.counters.num_exports == 1 and sender.ex.counters.num_requests == 0
    assert sender.ex.blocks_used == 0

    receiver = Driver(Executor(family_model, num_blocks=64, block_size=4, host_snapshot_blocks=64))
    header = _move(sender.ex, receiver.ex)
    assert header.num_pages == len(_tables(sender.ex, 0)[0])
    receiver.tokens = list(sender.tokens)
    receiver.run(
        adopt=[wire.SnapshotAdopt(request_id="a", ticket=TICKET)],
        swap_in=[wire.SwapIn(request_id="a", block_ids=_tables(receiver.ex, 20))],
    )
    assert receiver.ex.counters.num_staged == 0 and receiver.ex.counters.num_snapshots == 0
    assert receiver.finish(request.sampling.max_tokens) == expected
    assert len(expected) - moved_at >= 5, "most of the decode ran after the move"


def test_another_block_size_is_refused(llama: LoadedModel) -> None:
    sender = Driver(Executor(llama, num_blocks=64, block_size=4))
    sender.prefill(_request(0.0), _tables(sender.ex, 0))
    sender.decode_to_boundary(2)
    sender.run(export=[wire.SnapshotExport(request_id="a", ticket=TICKET)])
    receiver = Executor(llama, num_blocks=64, block_size=8, host_snapshot_blocks=64)
    with pytest.raises(migration.TransferError) as caught:
        _move(sender.ex, receiver)
    assert caught.value.failure is migration.TransferFailure.LAYOUT_MISMATCH
    assert "block_size" in caught.value.message


def test_another_checkpoint_of_the_same_shape_is_refused(
    llama: LoadedModel, tmp_path: Path
) -> None:
    other = load_model(
        make_tiny_model(tmp_path, TinyModelSpec(family=ModelFamily.LLAMA, vocab_size=128, seed=9))
    )
    sender = Driver(Executor(llama, num_blocks=64, block_size=4))
    sender.prefill(_request(0.0), _tables(sender.ex, 0))
    sender.decode_to_boundary(2)
    sender.run(export=[wire.SnapshotExport(request_id="a", ticket=TICKET)])
    receiver = Executor(other, num_blocks=64, block_size=4, host_snapshot_blocks=64)
    assert receiver.snapshot_layout.block_size == sender.ex.snapshot_layout.block_size
    with pytest.raises(migration.TransferError) as caught:
        _move(sender.ex, receiver)
    assert "model_fingerprint" in caught.value.message
