"""SmolLM2-135M moved mid-decode between two executors with its KV decodes on exactly as
without the move (greedy), and its layout names the real model's geometry."""

from __future__ import annotations

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel
from kvgate.protocol import step as wire
from tests.executor.test_executor_migration import TICKET, Driver, _move, _request, _tables


def test_smollm2_moved_mid_decode_keeps_its_greedy_tokens(kvgate_smollm2: LoadedModel) -> None:
    request = _request(0.0)
    reference = Driver(Executor(kvgate_smollm2, num_blocks=16, block_size=16))
    reference.prefill(request, _tables(reference.ex, 0))
    expected = reference.finish(request.sampling.max_tokens)

    sender = Driver(Executor(kvgate_smollm2, num_blocks=16, block_size=16))
    sender.prefill(request, _tables(sender.ex, 0))
    sender.decode_to_boundary(4)
    sender.run(export=[wire.SnapshotExport(request_id="a", ticket=TICKET)])
    receiver = Driver(
        Executor(kvgate_smollm2, num_blocks=16, block_size=16, host_snapshot_blocks=16)
    )
    header = _move(sender.ex, receiver.ex)
    layout = header.layout
    config = kvgate_smollm2.model.config
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (
        config.num_layers, config.num_kv_heads, config.head_dim,
    )  # fmt: skip
    receiver.tokens = list(sender.tokens)
    receiver.run(
        adopt=[wire.SnapshotAdopt(request_id="a", ticket=TICKET)],
        swap_in=[wire.SwapIn(request_id="a", block_ids=_tables(receiver.ex, 5))],
    )
    assert receiver.finish(request.sampling.max_tokens) == expected
