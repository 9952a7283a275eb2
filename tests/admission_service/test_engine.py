"""The engine over in-process simulated executors: placement, outputs equal to the reference,
executor loss and drain with identical outputs, aborts, hand-off, rejections at placement."""

from __future__ import annotations

import pytest

from kvgate.admission_service.placement import PlacementPolicy, PlacementSettings
from kvgate.protocol.admin import ExecutorSpec, ExecutorState
from kvgate.protocol.enums import FinishReason
from kvgate.protocol.records import RejectCode, ResultStatus

from .helpers import (
    make_rig,
    reference_outputs,
    request_body,
    settle,
    until,
)

pytestmark = pytest.mark.timeout(60)

# Two executors whose caches cannot hold the whole workload: preemption happens.
SMALL = {"num_blocks": 24, "block_size": 4, "host_snapshot_blocks": 16}


def mixed_workload(count: int = 16) -> list[dict[str, object]]:
    return [
        request_body(
            f"r{i:02d}", prompt_len=6 + (i * 5) % 17, max_tokens=6 + (i * 3) % 11, priority=i % 3
        )
        for i in range(count)
    ]


def outputs(rig_answers: dict[str, object]) -> dict[str, tuple[list[int], list[int]]]:
    return {
        rid: (r.output_token_ids, r.exit_depths)  # type: ignore[attr-defined]
        for rid, r in rig_answers.items()
    }


async def test_mixed_workload_matches_reference_under_cache_pressure() -> None:
    bodies = mixed_workload()
    expected = await reference_outputs(bodies, block_size=4)
    rig = make_rig()
    await rig.add_executors("a", "b", **SMALL)
    for body in bodies:
        rig.submit(body)
    await settle(rig, len(bodies))
    try:
        assert {r.status for r in rig.sink.answers.values()} == {ResultStatus.COMPLETED}
        assert outputs(rig.sink.answers) == expected
        preemptions = sum(r.scheduling.preemptions for r in rig.sink.answers.values())
        assert preemptions > 0, "the workload must put the caches under pressure"
        used = {r.scheduling.executors[0] for r in rig.sink.answers.values()}
        assert used == {"a", "b"}, "placement spreads work over both executors"
        # Every result names its source offset (effectively-once delivery depends on it).
        assert sorted(r.source.offset for r in rig.sink.answers.values()) == list(range(16))
    finally:
        await rig.engine.close()


async def test_placement_prefers_the_executor_with_more_free_capacity() -> None:
    """``placement.policy: headroom`` (the rule before cache-aware placement)."""
    rig = make_rig(placement=PlacementSettings(policy=PlacementPolicy.HEADROOM))
    await rig.add_executors("big", num_blocks=200)
    await rig.add_executors("small", num_blocks=40)
    backend_big = rig.connector.backends["big"]
    backend_small = rig.connector.backends["small"]
    backend_big.hold()
    backend_small.hold()
    try:
        # Each request needs ceil((12 + 8 - 1) / 16) = 2 blocks at full length.
        for i in range(6):
            rig.submit(request_body(f"p{i}"))
        placed = {rid: t.executor for rid, t in rig.engine._requests.items()}
        # big: 200 free, small: 40; each placement takes 2 from the chosen one's headroom.
        assert set(placed.values()) == {"big"}
    finally:
        backend_big.release()
        backend_small.release()
        await settle(rig, 6)
        await rig.engine.close()


async def test_executor_loss_resumes_elsewhere_with_identical_outputs() -> None:
    bodies = mixed_workload(12)
    expected = await reference_outputs(bodies, block_size=4)
    rig = make_rig()
    await rig.add_executors("a", "b", **SMALL)
    backend_a = rig.connector.backends["a"]
    backend_a.hold_after(6)  # the 6th step's result never comes back
    for body in bodies:
        rig.submit(body)
    try:
        # Lose "a" once it has produced some tokens, and keep it unreachable.
        await until(lambda: backend_a.steps >= 6, what="steps on a")
        started_on_a = {
            rid
            for rid, t in rig.engine._requests.items()
            if t.executor == "a" and t.first_token_at is not None
        }
        rig.connector.refused.add("a")
        rig.connector.lose("a")
        await settle(rig, len(bodies))
        assert outputs(rig.sink.answers) == expected
        moved = {
            r.request_id for r in rig.sink.answers.values() if r.scheduling.executors == ["a", "b"]
        }
        assert started_on_a & moved, "requests with tokens from a resumed on b by recompute"
        assert rig.engine.handles["a"].state is ExecutorState.LOST
    finally:
        await rig.engine.close()


async def test_lost_executor_reconnects_with_a_newer_epoch() -> None:
    rig = make_rig()
    await rig.add_executors("a", **SMALL)
    backend = rig.connector.backends["a"]
    try:
        await until(lambda: rig.engine.handles["a"].state is ExecutorState.READY)
        first_epoch = backend.fence.max_epoch
        rig.connector.lose("a")
        await until(lambda: rig.engine.handles["a"].sessions == 2, what="reconnect")
        assert backend.fence.max_epoch is not None and first_epoch is not None
        assert backend.fence.max_epoch > first_epoch
        rig.submit(request_body("after"))
        await settle(rig, 1)
        assert rig.sink.answers["after"].status is ResultStatus.COMPLETED
    finally:
        await rig.engine.close()


async def test_drain_moves_work_away_and_reports_drained() -> None:
    bodies = mixed_workload(10)
    expected = await reference_outputs(bodies, block_size=4)
    rig = make_rig()
    await rig.add_executors("a", "b", **SMALL)
    backend_a = rig.connector.backends["a"]
    try:
        backend_a.hold()
        for body in bodies:
            rig.submit(body)
        on_a = [t for t in rig.engine._requests.values() if t.executor == "a"]
        assert on_a
        status = rig.engine.drain("a")
        assert status is not None and status.state is ExecutorState.DRAINING
        backend_a.release()
        await until(lambda: rig.engine.handles["a"].state is ExecutorState.DRAINED, what="drained")
        rig.submit(request_body("late"))
        await settle(rig, len(bodies) + 1)
        assert rig.sink.answers["late"].scheduling.executors == ["b"]
        for tracked in on_a:
            assert rig.sink.answers[tracked.request_id].scheduling.executors[-1] == "b"
        del rig.sink.answers["late"]
        assert outputs(rig.sink.answers) == expected
        assert backend_a.executor.counters.num_requests == 0, "drained executor holds nothing"
    finally:
        await rig.engine.close()


async def test_draining_the_only_executor_lets_its_work_finish_there() -> None:
    rig = make_rig()
    await rig.add_executors("solo", **SMALL)
    backend = rig.connector.backends["solo"]
    try:
        backend.hold()
        for i in range(3):
            rig.submit(request_body(f"s{i}"))
        rig.engine.drain("solo")
        backend.release()
        await settle(rig, 3)
        assert {r.scheduling.executors[-1] for r in rig.sink.answers.values()} == {"solo"}
        await until(lambda: rig.engine.handles["solo"].state is ExecutorState.DRAINED)
    finally:
        await rig.engine.close()


async def test_membership_removal_moves_requests_and_new_members_connect() -> None:
    bodies = mixed_workload(8)
    expected = await reference_outputs(bodies, block_size=4)
    rig = make_rig()
    await rig.add_executors("a", "b", **SMALL)
    try:
        rig.connector.backends["a"].hold()
        for body in bodies:
            rig.submit(body)
        rig.connector.backends["a"].release()
        await rig.engine.set_members([ExecutorSpec(name="b", endpoint="ws://local/b")])
        assert set(rig.engine.handles) == {"b"}
        await settle(rig, len(bodies))
        assert outputs(rig.sink.answers) == expected
    finally:
        await rig.engine.close()


async def test_requests_wait_unplaced_until_an_executor_is_ready() -> None:
    rig = make_rig()
    try:
        rig.submit(request_body("early"))
        assert rig.engine.num_waiting == 1 and not rig.sink.answers
        await rig.add_executors("a", **SMALL)
        await settle(rig, 1)
        assert rig.sink.answers["early"].status is ResultStatus.COMPLETED
        assert rig.engine.num_waiting == 0
    finally:
        await rig.engine.close()


async def test_abort_running_waiting_and_before_arrival() -> None:
    rig = make_rig()
    try:
        rig.submit(request_body("waits"))  # no executor yet: unplaced
        assert rig.engine.abort("waits")
        assert rig.sink.answers["waits"].status is ResultStatus.ABORTED
        assert not rig.engine.abort("later")  # remembered
        await rig.add_executors("a", **SMALL)
        backend = rig.connector.backends["a"]
        backend.hold()
        rig.submit(request_body("runs", max_tokens=40))
        assert rig.engine.abort("runs")
        backend.release()
        rig.submit(request_body("later"))
        await settle(rig, 3)
        for rid in ("runs", "later"):
            result = rig.sink.answers[rid]
            assert result.status is ResultStatus.ABORTED
            assert result.finish_reason is FinishReason.ABORT
        await until(lambda: backend.executor.counters.num_requests == 0, what="freed")
    finally:
        await rig.engine.close()


async def test_deadline_passed_is_answered_as_aborted_with_reason_deadline() -> None:
    rig = make_rig()
    try:
        await rig.add_executors("a", **SMALL)
        rig.submit(request_body("late", deadline_unix_s=1.0))
        await settle(rig, 1)
        result = rig.sink.answers["late"]
        assert result.status is ResultStatus.ABORTED
        assert result.finish_reason is FinishReason.DEADLINE
    finally:
        await rig.engine.close()


async def test_infeasible_and_out_of_vocabulary_and_duplicate_are_rejected() -> None:
    rig = make_rig()
    try:
        await rig.add_executors("a", **SMALL)
        rig.connector.backends["a"].hold()
        rig.submit(request_body("huge", prompt_len=200))  # 24 blocks of 4 hold 96 tokens
        rig.submit(request_body("oov", prompt=[1, 2, 100_000]))
        rig.submit(request_body("twice"))
        rig.submit(request_body("twice"))
        codes = {rej.request_id: rej.code for _, rej, _ in rig.sink.rejects}
        assert codes == {
            "huge": RejectCode.INFEASIBLE,
            "oov": RejectCode.TOKEN_OUT_OF_VOCABULARY,
            "twice": RejectCode.DUPLICATE,
        }
        for record, rejection, result in rig.sink.rejects:
            assert rejection.reason
            if rejection.code is RejectCode.DUPLICATE:
                assert result is None, "a duplicate is dead-lettered without a second answer"
                continue
            assert result is not None and result.status is ResultStatus.REJECTED
            assert result.source.offset == record.offset
        rig.connector.backends["a"].release()
        await until(lambda: "twice" in rig.sink.answers)
        assert rig.sink.answers["twice"].status is ResultStatus.COMPLETED
        rig.submit(request_body("twice"))  # after its answer, too
        assert [r.request_id for _, r, res in rig.sink.rejects if res is None] == ["twice"] * 2
        assert [r.request_id for r in rig.sink.answer_log].count("twice") == 1
    finally:
        await rig.engine.close()


async def test_revoked_partition_is_handed_off_without_answers() -> None:
    rig = make_rig()
    try:
        await rig.add_executors("a", **SMALL)
        rig.connector.backends["a"].hold()
        rig.submit(request_body("p0"), partition=0)
        rig.submit(request_body("p1"), partition=1)
        assert rig.engine.drop_partition("kvgate.requests", 1) == 1
        rig.connector.backends["a"].release()
        await settle(rig, 1)
        await until(lambda: rig.engine.num_tracked == 0)
        assert set(rig.sink.answers) == {"p0"}
    finally:
        await rig.engine.close()


async def test_token_stream_carries_every_token_once_in_order_across_a_loss() -> None:
    rig = make_rig(token_stream=True)
    try:
        await rig.add_executors("a", "b", **SMALL)
        for i in range(6):
            rig.submit(request_body(f"t{i}", max_tokens=12))
        await until(lambda: len(rig.sink.streamed) >= 10, what="some tokens")
        rig.connector.lose("a")
        await settle(rig, 6)
        for rid, result in rig.sink.answers.items():
            chunks = [c for c in rig.sink.streamed if c.request_id == rid]
            assert [c.index for c in chunks] == list(range(len(result.output_token_ids)))
            assert [c.token_id for c in chunks] == result.output_token_ids
    finally:
        await rig.engine.close()


async def test_every_output_token_is_one_latency_observation() -> None:
    """A request's first token is one time-to-first-token observation of its executor, each
    later one an inter-token gap (a step's gaps are observed together)."""
    rig = make_rig()
    try:
        await rig.add_executors("a", **SMALL)
        for i in range(5):
            rig.submit(request_body(f"m{i}", max_tokens=9))
        await settle(rig, 5)
        tokens = sum(len(result.output_token_ids) for result in rig.sink.answers.values())

        def count(name: str) -> float:
            registry = rig.engine.metrics.registry
            return sum(s.value for f in registry.collect() for s in f.samples if s.name == name)

        assert tokens > 5
        assert count("vllm:time_to_first_token_seconds_count") == 5
        assert count("vllm:inter_token_latency_seconds_count") == tokens - 5
    finally:
        await rig.engine.close()


async def test_request_failing_on_too_many_executors_is_failed() -> None:
    rig = make_rig()  # max_request_failures = 3
    try:
        await rig.add_executors("a", **SMALL)
        backend = rig.connector.backends["a"]
        backend.hold()
        rig.submit(request_body("doomed", max_tokens=30))
        for _ in range(3):
            sessions = rig.engine.handles["a"].sessions
            rig.connector.lose("a")
            await until(lambda s=sessions: rig.engine.handles["a"].sessions > s, what="reconnect")
        await settle(rig, 1)
        result = rig.sink.answers["doomed"]
        assert result.status is ResultStatus.FAILED
        assert "executors failed" in (result.reason or "")
    finally:
        backend.release()
        await rig.engine.close()


class _AngleTokenizer:
    """Token ``i`` is the text ``<i>``: a stop string can name one token exactly."""

    def encode(self, text: str) -> list[int]:
        return [int(piece) for piece in text.replace(">", "").split("<") if piece]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(f"<{t}>" for t in token_ids)

    def render_chat(self, messages: object) -> str:
        raise AssertionError("not used")


async def test_a_stop_string_ends_generation_with_the_text_before_it() -> None:
    rig = make_rig(tokenizer=_AngleTokenizer())
    await rig.add_executors("a", num_blocks=64)
    try:
        # One answer per id: each run is a new request with the same prompt (the simulated
        # model's tokens depend on the prompt and seed, not on the id).
        prompt = request_body("s")["prompt"]
        body = request_body("s-full", prompt=prompt, max_tokens=12) | {"stop": ["<never>"]}
        rig.submit(body)
        await settle(rig, 1)
        full = rig.sink.answers.pop("s-full")
        assert full.finish_reason is FinishReason.LENGTH and len(full.output_token_ids) == 12
        third = full.output_token_ids[2]
        first = full.output_token_ids.index(third)  # the stop matches its first occurrence
        stops = ["<zzz>", f"<{third}>"]
        rig.submit(request_body("s-stop", prompt=prompt, max_tokens=12) | {"stop": stops})
        await settle(rig, 1)
        stopped = rig.sink.answers.pop("s-stop")
        assert stopped.status is ResultStatus.COMPLETED
        assert stopped.finish_reason is FinishReason.STOP
        assert stopped.output_token_ids == full.output_token_ids[: first + 1]
        assert stopped.text == "".join(f"<{t}>" for t in full.output_token_ids[:first])
        assert stopped.usage.completion_tokens == first + 1
        # The last token allowed completes the stop string: still a stop, not a length finish.
        last = full.output_token_ids[first]
        last_body = request_body("s-last", prompt=prompt, max_tokens=first + 1)
        rig.submit(last_body | {"stop": [f"<{last}>"]})
        await settle(rig, 1)
        at_limit = rig.sink.answers["s-last"]
        assert at_limit.finish_reason is FinishReason.STOP
        assert at_limit.output_token_ids == full.output_token_ids[: first + 1]
    finally:
        await rig.engine.close()


async def test_stop_strings_without_a_tokenizer_are_rejected() -> None:
    rig = make_rig()
    rig.submit(request_body("s") | {"stop": ["."]})
    await settle(rig, 1)
    answer = rig.sink.answers["s"]
    assert answer.status is ResultStatus.REJECTED
    assert answer.reject_code is RejectCode.TEXT_WITHOUT_TOKENIZER


async def test_logprobs_arrive_once_per_token_through_preemption_and_moves() -> None:
    """The simulated executor's logprob of the token at position p is -p/1000."""
    bodies = mixed_workload()
    for body in bodies[::2]:
        body["logprobs"] = 1
    rig = make_rig(tokenizer=_AngleTokenizer())
    await rig.add_executors("a", "b", **SMALL)
    for body in bodies:
        rig.submit(body)
    await settle(rig, len(bodies))
    try:
        answers = rig.sink.answers
        assert sum(r.scheduling.preemptions for r in answers.values()) > 0
        for i, body in enumerate(bodies):
            result = answers[str(body["request_id"])]
            if i % 2:
                assert result.logprobs is None
                continue
            assert result.logprobs is not None
            prompt_len = result.usage.prompt_tokens
            assert [e.token_id for e in result.logprobs] == result.output_token_ids
            assert [e.logprob for e in result.logprobs] == [
                -(prompt_len + k) / 1000 for k in range(len(result.output_token_ids))
            ]
            assert all([t.token_id for t in e.top] == [e.token_id] for e in result.logprobs)
            assert result.logprobs[0].token == f"<{result.output_token_ids[0]}>"
    finally:
        await rig.engine.close()
