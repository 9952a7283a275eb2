"""Tenants and deadlines in the one admission order: fair shares by virtual token counters, the
lift, earliest-deadline-first with the slack that keeps a request without a deadline from waiting
for good, the fair-order invariant, and moving a waiting request between schedulers."""

from __future__ import annotations

import pytest

from kvgate.scheduler.config import Policy
from kvgate.scheduler.errors import InvariantViolation
from kvgate.scheduler.events import AdmissionKind
from kvgate.scheduler.fairness import FairWaitingQueue, TenantClock
from kvgate.scheduler.invariants import Invariant
from kvgate.scheduler.policy import admission_key
from kvgate.scheduler.request import RequestStatus
from tests.scheduler.harness import Rig, spec


def _admission_order(rig: Rig) -> list[str]:
    return sorted(rig.finished, key=lambda rid: rig.finished[rid].stats.first_admitted_step or 0)


def _one_slot(**config: object) -> Rig:
    return Rig(
        num_blocks=256,
        max_num_seqs=1,
        prefill_chunk_size=8,
        max_num_batched_tokens=8,
        **config,
    )


def test_the_key_without_tenants_or_deadlines_is_unchanged() -> None:
    assert admission_key(Policy.PRIORITY, 3, 7) == (3, 7)
    assert admission_key(Policy.FCFS, 3, 7) == (7,)
    assert admission_key(Policy.PRIORITY, 3, 7, share=1.5, deadline_s=9.0) == (3, 1.5, 9.0, 7)
    assert admission_key(Policy.FCFS, 3, 7, deadline_s=9.0) == (9.0, 7)


def test_a_flooding_tenant_takes_turns_with_a_light_one_by_tokens_served() -> None:
    """One slot; h sends six requests, then l two, all at once: first come first served runs
    h's six first; the fair order runs l's each time its counter is the smaller."""
    for fairness, expected in (
        ("off", ["h0", "h1", "h2", "h3", "h4", "h5", "l0", "l1"]),
        ("tokens", ["h0", "l0", "h1", "l1", "h2", "h3", "h4", "h5"]),
    ):
        rig = _one_slot(fairness=fairness)
        for i in range(6):
            rig.add(f"h{i}", prompt_len=4, max_tokens=4, tenant="h")
        for i in range(2):
            rig.add(f"l{i}", prompt_len=4, max_tokens=4, tenant="l")
        rig.drain()
        assert _admission_order(rig) == expected, fairness


def test_weights_divide_the_tokens_of_backlogged_tenants() -> None:
    """Both tenants always backlogged, a weighing twice b: while both wait, a is served twice
    the tokens (counted over the admissions before either runs out)."""
    rig = Rig(
        num_blocks=512,
        max_num_seqs=3,
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
        fairness="tokens",
        tenant_weights={"a": 2.0},
    )
    for i in range(30):
        rig.add(f"a{i}", prompt_len=6, max_tokens=6, tenant="a")
        rig.add(f"b{i}", prompt_len=6, max_tokens=6, tenant="b")
    rig.drain(max_steps=2000)
    first_30 = _admission_order(rig)[:30]
    served_a = sum(1 for rid in first_30 if rid.startswith("a"))
    assert served_a / (30 - served_a) == pytest.approx(2.0, rel=0.1)


@pytest.mark.parametrize(("burst", "credit"), [(0, 8), (30, 30)])
def test_a_returning_tenant_is_lifted_and_gets_only_a_bounded_credit_for_idling(
    burst: int, credit: int
) -> None:
    """a runs alone for a while; b arrives with five requests. b is lifted to a's counter less
    its credit: one request's cost (4 + 4 tokens) or the burst, never the whole time it was
    idle; unlifted, b's counter of 0 would run all five of b's before a's next."""
    rig = _one_slot(fairness="tokens", fair_burst_tokens=burst)
    for i in range(12):
        rig.add(f"a{i}", prompt_len=4, max_tokens=4, tenant="a")
    for _ in range(30):
        rig.step()
    waiting = rig.scheduler.state.waiting
    assert isinstance(waiting, FairWaitingQueue)
    floor = waiting.clock.share((0, "a"))
    assert floor > credit
    rig.add("b0", prompt_len=4, max_tokens=4, tenant="b")
    assert waiting.clock.share((0, "b")) == floor - credit
    for i in range(1, 5):
        rig.add(f"b{i}", prompt_len=4, max_tokens=4, tenant="b")
    rig.drain()
    order = "".join(rid[0] for rid in _admission_order(rig))
    if burst == 0:
        assert "bbb" not in order and "bab" in order, order
    else:  # the burst: 30 tokens of credit are four of b's requests (8 each), not five
        assert "bbbb" in order and "bbbbb" not in order, order


def test_a_tenant_under_its_share_displaces_the_flood_at_once() -> None:
    """Two slots, both running h's requests, h's lane long; l's request arrives: it goes
    ahead of h's waiting ones and displaces h's latest running request in the same step.
    Without fairness it waits for a slot to drain."""
    for fairness, started_at_once in (("tokens", True), ("off", False)):
        rig = Rig(
            num_blocks=256,
            max_num_seqs=2,
            prefill_chunk_size=8,
            max_num_batched_tokens=16,
            fairness=fairness,
        )
        for i in range(8):
            rig.add(f"h{i}", prompt_len=6, max_tokens=20, tenant="h")
        for _ in range(6):
            rig.step()
        rig.add("l0", prompt_len=6, max_tokens=4, tenant="l")
        rig.step()
        report = rig.scheduler.last_report
        assert (("l0", AdmissionKind.FRESH) in report.admitted) is started_at_once, fairness
        if started_at_once:
            [preemption] = report.preemptions
            assert (preemption.requester_id, preemption.victim_id) == ("l0", "h1")
        rig.drain()


def test_backlogged_tenants_at_equal_shares_do_not_trade_victims() -> None:
    """Two tenants flooding at equal weights: admission preemption between them is rare (a
    preemption never takes the requester's tenant past the victim's)."""
    rig = Rig(
        num_blocks=512,
        max_num_seqs=4,
        prefill_chunk_size=8,
        max_num_batched_tokens=32,
        fairness="tokens",
        fair_burst_tokens=0,
    )
    for i in range(20):
        rig.add(f"a{i}", prompt_len=6, max_tokens=10, tenant="a")
        rig.add(f"b{i}", prompt_len=6, max_tokens=10, tenant="b")
    rig.drain(max_steps=2000)
    preempted = sum(e.stats.preemptions for e in rig.finished.values())
    assert preempted <= 2


def test_earliest_deadline_first_within_a_class() -> None:
    rig = _one_slot(deadline_order=True)
    rig.step()  # now = 1
    rig.add("late", prompt_len=4, max_tokens=2, deadline_s=900.0)
    rig.add("none", prompt_len=4, max_tokens=2)  # ordered at 1 + 600
    rig.add("soon", prompt_len=4, max_tokens=2, deadline_s=300.0)
    rig.add("urgent", prompt_len=4, max_tokens=2, priority=-1, deadline_s=950.0)
    rig.drain()
    assert _admission_order(rig) == ["urgent", "soon", "none", "late"]


@pytest.mark.parametrize(("slack_s", "bounded"), [(5.0, True), (1e9, False)])
def test_a_request_without_a_deadline_waits_only_until_its_slack_runs_out(
    slack_s: float, bounded: bool
) -> None:
    """A stream of requests each due three steps after it arrives: 'patient' (no deadline)
    is ordered at its arrival + slack, so with a slack of 5 every request arriving later is
    due after it and it runs within a few steps; with an endless slack the stream passes it
    for as long as it lasts."""
    rig = _one_slot(deadline_order=True, deadline_slack_s=slack_s)
    rig.step()
    rig.add("patient", prompt_len=2, max_tokens=1)
    started = None
    for i in range(60):
        rig.add(f"s{i}", prompt_len=2, max_tokens=1, deadline_s=rig.clock + 3)
        rig.step()
        request = rig.scheduler.state.requests.get("patient")
        if started is None and (request is None or request.first_admitted_step is not None):
            started = i
    rig.drain()
    assert rig.finished["patient"].reason.value == "length"
    if bounded:
        assert started is not None and started <= 8
    else:
        assert started is None  # it ran only once the stream ended


def test_the_fair_order_invariant_holds_and_catches_a_stale_stamp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checked after every step of a two-tenant run; with re-stamping broken (a head keeps the
    share it was stamped with while its tenant is served), the check fails."""

    def run() -> None:
        rig = Rig(
            num_blocks=128,
            max_num_seqs=2,
            prefill_chunk_size=4,
            max_num_batched_tokens=8,
            fairness="tokens",
        )
        for i in range(6):
            rig.add(f"h{i}", prompt_len=4, max_tokens=6, tenant="h")
            rig.add(f"l{i}", prompt_len=3, max_tokens=3, tenant="l")
        rig.drain()  # checks the invariants after every step

    run()
    monkeypatch.setattr(FairWaitingQueue, "_restamp", lambda self, lane: None)
    with pytest.raises(InvariantViolation, match="heap entries"):
        run()


def test_the_invariant_catches_an_unlifted_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_lift(self: TenantClock, lane: tuple[int, str], backlogged: object, cost: int) -> None:
        self._floors[lane[0]] = max(self.floor(lane[0]), 1e9)  # a floor it does not apply

    rig = _one_slot(fairness="tokens")
    rig.add("a0", prompt_len=4, max_tokens=2, tenant="a")
    monkeypatch.setattr(TenantClock, "lift", no_lift)
    rig.add("b0", prompt_len=4, max_tokens=2, tenant="b")
    problems = rig.scheduler.invariant_violations()
    assert any("below the floor" in p for p in problems[Invariant.FAIR_ORDER])


def test_a_request_moved_before_it_started_keeps_its_place_and_its_bypasses() -> None:
    """Withdrawn from one scheduler and added to another with its progress: the same arrival
    number, bypass count and ordering deadline."""
    source = _one_slot(deadline_order=True, max_admission_bypasses=3)
    source.add("run", prompt_len=4, max_tokens=30)
    source.step()
    source.add("big", prompt_len=300, max_tokens=2)  # cannot fit next to "run"
    source.add("small", prompt_len=2, max_tokens=2)
    waiting = source.scheduler.state.requests["big"]
    waiting.bypasses = 2
    progress = source.scheduler.withdraw("big")
    assert progress is not None and "big" not in source.scheduler.state.requests
    assert source.scheduler.withdraw("run") is None  # started: it has state on the executor
    target = _one_slot(deadline_order=True)
    moved = target.scheduler.add_request(progress.spec, progress=progress)
    assert (moved.arrival_seq, moved.bypasses) == (waiting.arrival_seq, 2)
    assert moved.order_deadline_s == waiting.order_deadline_s
    source.drain()
    target.drain()
    assert set(target.finished) == {"big"}


@pytest.mark.parametrize("fairness", ["off", "tokens"])
def test_a_request_withdrawn_and_put_back_waits_again_in_its_place(fairness: str) -> None:
    """Placement withdraws a waiting request and, its move refused, adds it back with its
    progress to the same scheduler: the queue still holds the withdrawn entry (removed entries
    are dropped lazily) under the same key and id. The two must not be confused, and the request
    keeps its place: ``a`` before ``b``, as they arrived."""
    rig = _one_slot(fairness=fairness)
    rig.add("run", prompt_len=4, max_tokens=6, tenant="t")
    rig.step()
    rig.add("a", prompt_len=4, max_tokens=2, tenant="t")
    rig.add("b", prompt_len=4, max_tokens=2, tenant="t")
    progress = rig.scheduler.withdraw("a")
    assert progress is not None
    rig.scheduler.add_request(progress.spec, progress=progress)
    rig.drain()
    assert _admission_order(rig) == ["run", "a", "b"]


@pytest.mark.parametrize("mode", ["snapshot", "recompute"])
def test_a_preempted_request_waiting_again_is_not_withdrawn(mode: str) -> None:
    """A victim waits again, but it was admitted here: its key is fixed, and a snapshot holds
    host blocks and executor state. Moving it would leak both and drop its key, so ``withdraw``
    declines and it finishes where it is."""
    rig = Rig(
        num_blocks=12,
        block_size=2,
        loops=2,
        host_snapshot_blocks=64,
        preemption=mode,
        watermark_ratio=0.0,
        growth_reserve_steps=0,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        prefill_chunk_size=8,
    )
    rig.add("v", prompt_len=4, max_tokens=8, priority=10)
    while len(rig.scheduler.state.requests["v"].output_token_ids) < 2:
        rig.step()
    rig.add("hi", prompt_len=8, max_tokens=2, priority=0)
    rig.step()
    [preemption] = rig.scheduler.last_report.preemptions
    assert preemption.victim_id == "v"
    assert rig.scheduler.state.requests["v"].status is RequestStatus.WAITING
    assert rig.scheduler.withdraw("v") is None
    rig.drain()
    assert set(rig.finished) == {"v", "hi"}
    assert rig.scheduler.state.host_blocks_used == 0


def test_prefix_cache_lookups_are_reported_per_step() -> None:
    rig = Rig(num_blocks=64, block_size=2, max_num_seqs=4)
    shared = tuple(range(10))
    rig.scheduler.add_request(spec("a", 0, 2, prompt=(*shared, 50)))
    rig.step()
    report = rig.scheduler.last_report
    assert (report.prefix_queried_tokens, report.prefix_hit_tokens) == (11, 0)
    rig.drain()
    rig.scheduler.add_request(spec("b", 0, 2, prompt=(*shared, 60)))
    rig.step()
    report = rig.scheduler.last_report
    assert (report.prefix_queried_tokens, report.prefix_hit_tokens) == (11, 10)
