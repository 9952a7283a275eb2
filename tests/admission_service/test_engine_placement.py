"""The engine's placement over simulated executors: a follow-up goes where its prefix is
cached (and the hit is counted per executor), a waiting request moves to an executor that
joins with its place kept, tenants reach the scheduler, and quotas reject what is over."""

from __future__ import annotations

from kvgate.protocol.admin import ExecutorSpec, ExecutorState
from kvgate.protocol.records import RejectCode, ResultStatus
from kvgate.protocol.tenants import TenantQuota, TenantsSettings
from kvgate.sim.backend import SimExecutorConfig

from .helpers import (
    make_rig,
    reference_outputs,
    request_body,
    scheduler_config,
    settle,
    until,
)

EXECUTOR = {"num_blocks": 256, "block_size": 4}
HISTORY = [(7 * i) % 500 + 1 for i in range(64)]


async def test_a_follow_up_goes_where_its_prefix_is_cached() -> None:
    rig = make_rig()
    await rig.add_executors("a", "b", "c", **EXECUTOR)
    try:
        rig.submit(request_body("turn-1", prompt=HISTORY, max_tokens=4))
        await settle(rig, 1)
        first = rig.sink.answers["turn-1"].scheduling.executors[0]
        rig.submit(request_body("turn-2", prompt=[*HISTORY, 9, 10, 11], max_tokens=4))
        rig.submit(request_body("other", prompt=[400 + i for i in range(60)], max_tokens=4))
        await settle(rig, 3)
        assert rig.sink.answers["turn-2"].scheduling.executors == [first]
        value = rig.engine.metrics.registry.get_sample_value
        hits = value("kvgate_admission_prefix_cache_hit_tokens_total", {"executor": first})
        assert hits == 60  # turn 1's 15 full pages (its last token is never cached)
        assert (
            value("vllm:prefix_cache_hits_total", {"model_name": "kvgate", "engine": first}) == hits
        )
        queried = value(
            "vllm:prefix_cache_queries_total", {"model_name": "kvgate", "engine": first}
        )
        assert queried is not None and queried >= 64 + 67
    finally:
        await rig.engine.close()


async def test_a_waiting_request_moves_to_an_executor_that_joins_with_its_place() -> None:
    bodies = [request_body(f"r{i}", max_tokens=6) for i in range(4)]
    expected = await reference_outputs(bodies, **EXECUTOR)
    rig = make_rig(scheduler=scheduler_config(max_num_seqs=1))
    await rig.add_executors("a", **EXECUTOR)
    backend_a = rig.connector.backends["a"]
    backend_a.hold()
    try:
        for body in bodies:
            rig.submit(body)
        handle_a = rig.engine.handles["a"]
        await until(lambda: handle_a.scheduler is not None and handle_a.scheduler.num_running == 1)
        waiting = handle_a.unstarted(10)
        assert len(waiting) == 3
        arrival = {rid: rig.engine._requests[rid].arrival_seq for rid in waiting}
        rig.connector.add("b", SimExecutorConfig(executor_id="b", **EXECUTOR))
        rig.connector.backends["b"].hold()  # so what moved is still there to look at
        await rig.engine.set_members(
            [ExecutorSpec(name=n, endpoint=f"ws://local/{n}") for n in ("a", "b")]
        )
        await until(lambda: rig.engine.handles["b"].state is ExecutorState.READY)
        moved = [rid for rid, t in rig.engine._requests.items() if t.executor == "b"]
        assert moved == [waiting[0]], "the oldest waiting request moves, as many as b has slots"
        tracked = rig.engine._requests[moved[0]]
        assert (tracked.moves, tracked.executors) == (1, ["a", "b"])
        scheduler_b = rig.engine.handles["b"].scheduler
        assert scheduler_b is not None
        assert scheduler_b.state.requests[moved[0]].arrival_seq == arrival[moved[0]]
        assert (
            rig.engine.metrics.registry.get_sample_value("kvgate_admission_placement_moves_total")
            == 1
        )
        backend_a.release()
        rig.connector.backends["b"].release()
        await settle(rig, len(bodies))
        for rid, (tokens, depths) in expected.items():
            answer = rig.sink.answers[rid]
            assert (answer.output_token_ids, answer.exit_depths) == (tokens, depths), rid
    finally:
        for backend in rig.connector.backends.values():
            backend.release()
        await rig.engine.close()


async def test_the_tenant_of_the_record_reaches_the_scheduler() -> None:
    rig = make_rig()
    await rig.add_executors("a", **EXECUTOR)
    backend = rig.connector.backends["a"]
    backend.hold()
    try:
        rig.submit(request_body("t", tenant="team-a"))
        rig.submit(request_body("u"))
        scheduler = rig.engine.handles["a"].scheduler
        assert scheduler is not None
        assert scheduler.state.requests["t"].tenant == "team-a"
        assert scheduler.state.requests["u"].tenant == "default"
    finally:
        backend.release()
        await settle(rig, 2)
        await rig.engine.close()


async def test_a_tenant_over_its_quota_is_rejected_and_others_are_not() -> None:
    """Each request costs 12 prompt + 8 output tokens; team-a may use 50 a minute: two pass,
    the third is rejected until the bucket refills. team-b has no quota."""
    quotas = TenantsSettings(quotas={"team-a": TenantQuota(tokens_per_minute=50)})
    rig = make_rig(tenants=quotas)
    await rig.add_executors("a", **EXECUTOR)
    try:
        for i in range(3):
            rig.submit(request_body(f"a{i}", tenant="team-a"))
        for i in range(3):
            rig.submit(request_body(f"b{i}", tenant="team-b"))
        await settle(rig, 6)
        answers = rig.sink.answers
        assert [answers[f"a{i}"].status for i in range(3)] == [
            ResultStatus.COMPLETED,
            ResultStatus.COMPLETED,
            ResultStatus.REJECTED,
        ]
        assert answers["a2"].reject_code is RejectCode.QUOTA_EXCEEDED
        assert "team-a" in (answers["a2"].reason or "")
        assert all(answers[f"b{i}"].status is ResultStatus.COMPLETED for i in range(3))
    finally:
        await rig.engine.close()
