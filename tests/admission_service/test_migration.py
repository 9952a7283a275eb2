"""Drain with KV snapshot migration over in-process simulated executors.

A drain moves each request at a token boundary with its KV to another executor: outputs equal
the no-drain reference token for token, a migrated request recomputes nothing, and every
request is answered once. A transfer that fails (sender killed, a corrupted chunk, a receiver
without host room) falls back to recompute with the same guarantees, and says so in the
metrics and on the request span.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kvgate.protocol import migration
from kvgate.protocol.admin import ExecutorState
from kvgate.protocol.enums import RestoreMode
from kvgate.protocol.records import ResultStatus
from kvgate.step_server.snapshots import MigrationLimits
from kvgate.telemetry import attributes as attr

from .helpers import EngineRig, make_rig, reference_outputs, request_body, settle, until

pytestmark = pytest.mark.timeout(60)

# Room for the whole workload on either executor; host room for every migrated snapshot.
ROOMY = {"num_blocks": 96, "block_size": 4, "host_snapshot_blocks": 512}


def workload(count: int = 10) -> list[dict[str, object]]:
    return [
        request_body(f"m{i:02d}", prompt_len=5 + (i * 7) % 13, max_tokens=12 + (i * 5) % 9)
        for i in range(count)
    ]


def outcomes(rig: EngineRig) -> dict[str, float]:
    counts: dict[str, float] = {}
    for metric in rig.engine.metrics.migrations.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                counts[sample.labels["outcome"]] = sample.value
    return counts


def migration_events(rig: EngineRig) -> dict[str, list[str]]:
    """Request id -> the outcomes its span recorded, in order."""
    events: dict[str, list[str]] = {}
    for span in rig.spans.get_finished_spans():
        rid = (span.attributes or {}).get(attr.GEN_AI_RESPONSE_ID)
        for event in span.events:
            if event.name == attr.MIGRATION_EVENT and rid is not None:
                outcome = (event.attributes or {})[attr.MIGRATION_OUTCOME]
                events.setdefault(str(rid), []).append(str(outcome))
    return events


async def drain_mid_run(rig: EngineRig, bodies: list[dict[str, object]]) -> list[str]:
    """Run ``bodies`` on ``a`` only, drain it after a few steps, and let ``b`` finish them.
    Returns the ids that were on ``a`` with tokens out when it drained."""
    await rig.add_executors("a", **ROOMY)  # b joins once a holds everything
    backend_a = rig.connector.backends["a"]
    backend_a.hold_after(5)
    for body in bodies:
        rig.submit(body)
    await until(lambda: backend_a._held, what="a held after 5 steps")
    await rig.add_executors("b", **ROOMY)
    running = [
        rid
        for rid, request in rig.engine.handles["a"].scheduler.state.requests.items()  # type: ignore[union-attr]
        if request.output_token_ids
    ]
    assert running, "requests must be mid-decode when the drain starts"
    rig.engine.drain("a")
    backend_a.release()
    await settle(rig, len(bodies))
    await until(lambda: rig.engine.handles["a"].state is ExecutorState.DRAINED, what="drained")
    return running


def answered_once(rig: EngineRig, bodies: list[dict[str, object]]) -> None:
    counts = Counter(r.request_id for r in rig.sink.answer_log)
    assert counts == Counter({str(b["request_id"]): 1 for b in bodies})
    assert {r.status for r in rig.sink.answers.values()} == {ResultStatus.COMPLETED}


def outputs(rig: EngineRig) -> dict[str, tuple[list[int], list[int]]]:
    return {rid: (r.output_token_ids, r.exit_depths) for rid, r in rig.sink.answers.items()}


async def test_drain_migrates_running_requests_with_their_kv() -> None:
    bodies = workload()
    expected = await reference_outputs(bodies, block_size=4)
    rig = make_rig(migrate_on_drain=True)
    try:
        moved = await drain_mid_run(rig, bodies)
        answered_once(rig, bodies)
        assert outputs(rig) == expected
        for rid in moved:
            facts = rig.sink.answers[rid].scheduling
            assert facts.executors == ["a", "b"]
            assert facts.recomputed_tokens == 0, rid
            assert RestoreMode.SNAPSHOT in facts.restore_modes
        assert outcomes(rig).get("migrated") == len(moved)
        events = migration_events(rig)
        assert all(events[rid] == ["migrated"] for rid in moved)
        assert rig.connector.transfers == len(moved)
        # Nothing left behind on either side: exports taken, imports adopted and restored.
        for backend in rig.connector.backends.values():
            counters = backend.executor.counters
            assert (counters.num_exports, counters.num_staged, counters.num_snapshots) == (0, 0, 0)
    finally:
        await rig.engine.close()


async def test_without_migration_the_drain_recomputes() -> None:
    bodies = workload()
    expected = await reference_outputs(bodies, block_size=4)
    rig = make_rig(migrate_on_drain=False)
    try:
        moved = await drain_mid_run(rig, bodies)
        answered_once(rig, bodies)
        assert outputs(rig) == expected
        assert all(rig.sink.answers[rid].scheduling.recomputed_tokens > 0 for rid in moved)
        assert outcomes(rig) == {} and rig.connector.transfers == 0
    finally:
        await rig.engine.close()


async def _fallback(rig: EngineRig, bodies: list[dict[str, object]], outcome: str) -> None:
    expected = await reference_outputs(bodies, block_size=4)
    try:
        moved = await drain_mid_run(rig, bodies)
        answered_once(rig, bodies)
        assert outputs(rig) == expected
        for rid in moved:
            facts = rig.sink.answers[rid].scheduling
            assert facts.recomputed_tokens > 0, f"{rid} fell back to recompute"
            assert migration_events(rig)[rid] == [outcome]
        assert outcomes(rig).get(outcome) == len(moved)
        assert "migrated" not in outcomes(rig)
    finally:
        await rig.engine.close()


async def test_a_killed_sender_falls_back_to_recompute() -> None:
    rig = make_rig(migrate_on_drain=True)
    killed: list[str] = []

    def kill_once(name: str, request_id: str) -> None:
        if not killed:
            killed.append(name)
            # The sender dies after the export, before the fetch; the service keeps its
            # session until it notices, so the handle's requests are already lifted.
            rig.connector.backends[name].executor.reset()
            rig.connector.refused.add(name)

    rig.connector.before_fetch = kill_once
    await _fallback(rig, workload(), migration.TransferFailure.SENDER_GONE.value)


async def test_a_defect_in_a_transfer_still_loses_no_request() -> None:
    """Anything a transfer raises that is not a refusal (here a plain RuntimeError from the
    transport) is counted as ``error`` and the request resumes by recompute."""
    rig = make_rig(migrate_on_drain=True)

    def broken_transport(name: str, request_id: str) -> None:
        raise RuntimeError("transport defect")

    rig.connector.before_fetch = broken_transport
    await _fallback(rig, workload(), "error")


async def test_a_corrupted_chunk_falls_back_to_recompute() -> None:
    rig = make_rig(migrate_on_drain=True)
    rig.connector.limits = MigrationLimits(chunk_bytes=64)

    def flip_a_payload_byte(frames: list[bytes]) -> list[bytes]:
        last = bytearray(frames[-1])
        last[-1] ^= 0x01
        return [*frames[:-1], bytes(last)]

    rig.connector.tamper = flip_a_payload_byte
    await _fallback(rig, workload(), migration.TransferFailure.CHECKSUM.value)


async def test_a_receiver_without_host_room_falls_back_to_recompute() -> None:
    rig = make_rig(migrate_on_drain=True)
    original = rig.add_executors

    async def b_without_host_room(*names: str, **config: object) -> None:
        if names == ("b",):
            config = {**config, "host_snapshot_blocks": 0}
        await original(*names, **config)

    rig.add_executors = b_without_host_room  # type: ignore[method-assign]
    await _fallback(rig, workload(), migration.TransferFailure.NO_HOST_ROOM.value)


async def test_an_abort_while_the_kv_is_in_transit_is_answered_once() -> None:
    bodies = workload()
    rig = make_rig(migrate_on_drain=True)
    aborted: list[str] = []

    def abort_the_first(name: str, request_id: str) -> None:
        if not aborted:
            aborted.append(request_id)
            assert rig.engine.abort(request_id)

    rig.connector.before_fetch = abort_the_first
    try:
        moved = await drain_mid_run(rig, bodies)
        counts = Counter(r.request_id for r in rig.sink.answer_log)
        assert counts == Counter({str(b["request_id"]): 1 for b in bodies})
        (rid,) = aborted
        assert rig.sink.answers[rid].status is ResultStatus.ABORTED
        # Its span ended with the abort's answer: the metric is where "abandoned" shows.
        assert rid not in migration_events(rig)
        counted = outcomes(rig)
        assert (counted["abandoned"], counted["migrated"]) == (1, len(moved) - 1)
    finally:
        await rig.engine.close()
