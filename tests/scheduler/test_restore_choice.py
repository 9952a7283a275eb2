"""``preemption: auto``: each victim comes back the cheaper way its cost model says, within the
host budget, and the choice is reported (the preemption, the plan's action, the restore kind,
the request's stats).

The scenario: a low-priority request ``v`` decodes until a more important arrival ``hi`` needs
its blocks; admission evicts ``v``. At that moment ``v`` holds 3 pages of 2 planes (6 blocks) and
has 5 positions of complete K/V, so::

    snapshot cost  = 6 blocks × snapshot_block_cost_s
    recompute cost = 5 positions × 2 passes × recompute_token_pass_cost_s

The costs below differ by a factor of at least 100 either way, so which one is cheaper does not
depend on rounding.
"""

from __future__ import annotations

import pytest

from kvgate.protocol.enums import RestoreMode
from kvgate.scheduler.events import AdmissionKind
from tests.scheduler.harness import Rig

VICTIM_BLOCKS = 6  # 3 pages × 2 planes
VICTIM_KV_POSITIONS = 5
CHEAP, DEAR = 1e-6, 1e-2


def _evict_v(*, snapshot_block_cost_s: float, recompute_token_pass_cost_s: float, host: int) -> Rig:
    rig = Rig(
        num_blocks=12,
        block_size=2,
        loops=2,
        host_snapshot_blocks=host,
        preemption="auto",
        snapshot_block_cost_s=snapshot_block_cost_s,
        recompute_token_pass_cost_s=recompute_token_pass_cost_s,
        watermark_ratio=0.0,
        growth_reserve_steps=0,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        prefill_chunk_size=8,
    )
    rig.add("v", prompt_len=4, max_tokens=8, priority=10)
    while len(rig.scheduler.state.requests["v"].output_token_ids) < 2:
        rig.step()
    v = rig.scheduler.state.requests["v"]
    assert rig.scheduler.state.pool.num_pages("v") * 2 == VICTIM_BLOCKS
    assert v.kv_frontier == VICTIM_KV_POSITIONS
    rig.add("hi", prompt_len=8, max_tokens=2, priority=0)
    rig.step()
    return rig


def _expected(snapshot_block_cost_s: float, recompute_token_pass_cost_s: float) -> RestoreMode:
    snapshot = VICTIM_BLOCKS * snapshot_block_cost_s
    recompute = VICTIM_KV_POSITIONS * 2 * recompute_token_pass_cost_s
    return RestoreMode.SNAPSHOT if snapshot < recompute else RestoreMode.RECOMPUTE


@pytest.mark.parametrize(
    ("snapshot_block_cost_s", "recompute_token_pass_cost_s", "mode"),
    [
        (CHEAP, DEAR, RestoreMode.SNAPSHOT),  # recomputing costs more: keep the K/V
        (DEAR, CHEAP, RestoreMode.RECOMPUTE),  # moving blocks costs more: recompute
    ],
)
def test_auto_takes_the_cheaper_restore_and_reports_it(
    snapshot_block_cost_s: float, recompute_token_pass_cost_s: float, mode: RestoreMode
) -> None:
    assert _expected(snapshot_block_cost_s, recompute_token_pass_cost_s) is mode
    rig = _evict_v(
        snapshot_block_cost_s=snapshot_block_cost_s,
        recompute_token_pass_cost_s=recompute_token_pass_cost_s,
        host=64,
    )
    [preemption] = rig.scheduler.last_report.preemptions
    assert (preemption.victim_id, preemption.requester_id, preemption.mode) == ("v", "hi", mode)
    plan = rig.plans[-1]
    if mode is RestoreMode.SNAPSHOT:
        assert plan.swap_out == ["v"] and "v" not in plan.free
    else:
        assert plan.free == ["v"] and not plan.swap_out
    restored: list[str] = []
    for _ in range(200):
        if not rig.scheduler.has_work:
            break
        rig.step()
        restored += [kind for rid, kind in rig.scheduler.last_report.admitted if rid == "v"]
    assert restored == [AdmissionKind.SNAPSHOT if mode is RestoreMode.SNAPSHOT else "recompute"]
    stats = rig.finished["v"].stats
    assert stats.restore_modes == (mode,) and stats.preemptions == 1
    if mode is RestoreMode.RECOMPUTE:  # its lost positions, less a prompt page found cached
        assert 0 < stats.recomputed_tokens <= VICTIM_KV_POSITIONS
    else:
        assert stats.recomputed_tokens == 0
    assert rig.scheduler.state.host_blocks_used == 0


@pytest.mark.parametrize(
    ("host", "mode"), [(VICTIM_BLOCKS - 1, "recompute"), (VICTIM_BLOCKS, "snapshot")]
)
def test_auto_snapshots_only_within_the_host_budget(host: int, mode: str) -> None:
    """A snapshot would be cheaper, but it must fit the host memory left: one block short, the
    victim is recomputed; exactly enough, it is snapshotted."""
    rig = _evict_v(snapshot_block_cost_s=CHEAP, recompute_token_pass_cost_s=DEAR, host=host)
    [preemption] = rig.scheduler.last_report.preemptions
    assert preemption.mode is RestoreMode(mode)
    assert rig.scheduler.state.host_blocks_used == (VICTIM_BLOCKS if mode == "snapshot" else 0)
    rig.drain()
    assert rig.finished["v"].stats.restore_modes == (RestoreMode(mode),)


def test_outputs_are_the_same_whichever_way_the_victim_comes_back() -> None:
    outputs = []
    for costs in ((CHEAP, DEAR), (DEAR, CHEAP)):
        rig = _evict_v(
            snapshot_block_cost_s=costs[0], recompute_token_pass_cost_s=costs[1], host=64
        )
        rig.drain()
        outputs.append(
            {rid: (e.output_token_ids, e.exit_depths) for rid, e in rig.finished.items()}
        )
    roomy = Rig(num_blocks=64, block_size=2, loops=2, preemption="off", growth_reserve_steps=0)
    roomy.add("v", prompt_len=4, max_tokens=8, priority=10)
    roomy.add("hi", prompt_len=8, max_tokens=2, priority=0)
    roomy.drain()
    reference = {rid: (e.output_token_ids, e.exit_depths) for rid, e in roomy.finished.items()}
    assert outputs == [reference, reference]
