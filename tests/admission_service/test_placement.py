"""Cache-aware placement as a pure rule: the cost, the load bound, room, affinity keys,
re-evaluation with its margin and move limit, and the imbalance bound as a property."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.admission_service.placement import (
    Ask,
    ExecutorView,
    PlacementPolicy,
    PlacementSettings,
    Placer,
    pull,
)
from kvgate.scheduler.kv import page_hashes

BLOCK = 4
SYSTEM = tuple(range(100, 132))  # 32 tokens: 8 pages


@dataclass(eq=False)
class FakeView:
    name: str
    outstanding: int = 0
    backlog_tokens: int = 0
    headroom_blocks: int = 1000
    cached: set[bytes] = field(default_factory=set)
    block_size: int = BLOCK

    def cache(self, prompt: Sequence[int]) -> None:
        self.cached |= set(page_hashes(prompt, self.block_size))

    def cached_prefix_pages(self, digests: Sequence[bytes]) -> int:
        count = 0
        for digest in digests:
            if digest not in self.cached:
                break
            count += 1
        return count

    def has_room_for(self, prompt_len: int, max_tokens: int) -> bool:
        return self.headroom_blocks >= -(-(prompt_len + max_tokens) // self.block_size)


def _ask(rid: str, prompt: Sequence[int], key: str | None = None, moves: int = 0) -> Ask:
    return Ask(rid, tuple(prompt), 8, key, moves)


def _names(views: Sequence[ExecutorView]) -> list[str]:
    return [view.name for view in views]


def test_the_executor_holding_the_prefix_wins_over_an_idle_one() -> None:
    a, b = FakeView("a", outstanding=2), FakeView("b")
    a.cache((*SYSTEM, 1))
    placer = Placer(PlacementSettings(load_tokens_per_request=4))
    ask = _ask("r", (*SYSTEM, 7, 8, 9))
    assert placer.price(ask, a).cached_tokens == 32
    # a: 35 - 32 + 2 × 4 = 11; b: 35 - 0 = 35.
    assert [placer.price(ask, v).cost_tokens for v in (a, b)] == [11, 35]
    assert _names(placer.rank(ask, [b, a])) == ["a", "b"]


def test_queued_work_outweighs_a_small_saving() -> None:
    a, b = FakeView("a", backlog_tokens=500), FakeView("b")
    a.cache((*SYSTEM, 1))
    assert _names(Placer(PlacementSettings()).rank(_ask("r", (*SYSTEM, 5)), [a, b]))[0] == "b"


def test_the_load_bound_keeps_a_popular_prefix_from_making_a_hot_spot() -> None:
    """a holds the prefix but 9 requests; the least loaded holds 1: the bound is
    1.25 × 1 + 4 = 5.25, so a is no candidate and comes last."""
    a, b, c = FakeView("a", outstanding=9), FakeView("b", outstanding=1), FakeView("c", 3)
    a.cache((*SYSTEM, 1))
    ranked = _names(Placer(PlacementSettings()).rank(_ask("r", (*SYSTEM, 5)), [a, b, c]))
    assert ranked == ["b", "c", "a"]


def test_room_for_the_full_length_comes_first() -> None:
    a, b = FakeView("a", headroom_blocks=3), FakeView("b", headroom_blocks=100)
    a.cache((*SYSTEM, 1))
    assert _names(Placer(PlacementSettings()).rank(_ask("r", (*SYSTEM, 5)), [a, b]))[0] == "b"


def test_the_headroom_policy_is_the_rule_before() -> None:
    a, b = FakeView("a", headroom_blocks=10), FakeView("b", headroom_blocks=20)
    a.cache((*SYSTEM, 1))
    placer = Placer(PlacementSettings(policy=PlacementPolicy.HEADROOM))
    assert _names(placer.rank(_ask("r", (*SYSTEM, 5)), [a, b])) == ["b", "a"]
    assert placer.better(_ask("r", (*SYSTEM, 5)), a, 0, [b]) is None


def test_an_affinity_key_follows_a_prompt_still_being_filled() -> None:
    """Turn 2 extends turn 1's prompt while turn 1 is still on a (nothing cached yet): the key
    sends it to a; once turn 1 leaves, only the cache speaks."""
    a, b = FakeView("a", outstanding=1), FakeView("b")
    placer = Placer(PlacementSettings())
    history = tuple(range(1000, 1201))  # 201 tokens: 50 full pages before the last
    turn1 = _ask("t1", history, key="session-1")
    placer.placed(turn1, a)
    turn2 = _ask("t2", (*history, 50, 51), key="session-1")
    assert placer.price(turn2, a).cached_tokens == 200
    assert _names(placer.rank(turn2, [b, a]))[0] == "a"
    stranger = _ask("x", (*history, 50, 51), key="session-2")
    assert placer.price(stranger, a).cached_tokens == 0
    placer.left("t1", "session-1")
    assert placer.price(turn2, a).cached_tokens == 0


def test_a_waiting_request_moves_only_by_the_margin_and_only_so_often() -> None:
    here, there = FakeView("here", backlog_tokens=300), FakeView("there")
    placer = Placer(PlacementSettings(move_margin_tokens=64, max_moves=1))
    ask = _ask("r", (*SYSTEM, 5))  # 33 tokens; 300 - 33 of others' queued ahead of it here
    best = placer.better(ask, here, 33, [there])
    assert best is not None and best.view is there
    assert placer.better(_ask("r", (*SYSTEM, 5), moves=1), here, 33, [there]) is None
    close = FakeView("close", backlog_tokens=90)
    assert placer.better(ask, close, 33, [there]) is None  # 57 ahead: less than the margin


def test_a_freed_executor_pulls_the_oldest_first_up_to_its_budget() -> None:
    busy, free = FakeView("busy", backlog_tokens=1000, outstanding=5), FakeView("free")
    placer = Placer(PlacementSettings())
    queued = [(busy, _ask(f"r{i}", (i, *SYSTEM)), 33) for i in range(5)]
    moved: list[str] = []

    def move(ask: Ask, source: ExecutorView, target: ExecutorView) -> bool:
        moved.append(ask.request_id)
        return ask.request_id != "r1"  # r1 started meanwhile: not moved, not counted

    assert pull(placer, free, queued, 2, move) == 2
    assert moved == ["r0", "r1", "r2"]


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    st.integers(2, 6),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.booleans()), max_size=80),
)
def test_the_load_bound_holds_at_every_placement(
    num_executors: int, events: list[tuple[int, int, bool]]
) -> None:
    """Requests sharing a few prefixes arrive (and some finish) in any order: the executor
    chosen never holds more than (1 + spread) × least + slack before the new request."""
    config = PlacementSettings()
    placer = Placer(config)
    views = [FakeView(f"e{i}") for i in range(num_executors)]
    placed: list[tuple[FakeView, str]] = []
    for index, (prefix, finish, is_arrival) in enumerate(events):
        if not is_arrival and placed:
            view, rid = placed.pop(finish % len(placed))
            view.outstanding -= 1
            placer.left(rid, None)
            continue
        prompt = (prefix, *SYSTEM, index)
        ask = _ask(f"r{index}", prompt, key=f"k{prefix}")
        chosen = placer.rank(ask, views)[0]
        assert isinstance(chosen, FakeView)
        least = min(v.outstanding for v in views)
        assert chosen.outstanding <= (1 + config.load_spread) * least + config.load_slack_requests
        chosen.outstanding += 1
        chosen.cache(prompt)
        placer.placed(ask, chosen)
        placed.append((chosen, ask.request_id))
